#!/bin/bash
# Nsight Compute full-set profiles of attention calls on the device: for each argument (bench/ncu_target.py's, e.g.
# "bf16 256 2048 none" or "e4m3 128 16384 none"), the per-SASS-instruction source page (csv: stall samples,
# instructions executed) and the details page, tarred into $OUT/prof.tgz. One device call:
#   bash bench/ncu_profile.sh "bf16 256 2048 none" "e4m3 128 16384 none"
set -u
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/lark*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p /tmp/prof
for spec in "$@"; do
  name=$(echo $spec | tr ' ' '_')
  timeout 200 ncu --profile-from-start off --set full --import-source yes -o /tmp/prof/$name python3 bench/ncu_target.py $spec > /tmp/prof/$name.log 2>&1
  echo "$spec rc=$?"; tail -3 /tmp/prof/$name.log
  ncu -i /tmp/prof/$name.ncu-rep --page source --csv --print-source sass > /tmp/prof/$name.sass.csv 2>/dev/null
  ncu -i /tmp/prof/$name.ncu-rep --page details > /tmp/prof/$name.details.txt 2>/dev/null
  grep -E "Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput" /tmp/prof/$name.details.txt | head -8
done
cd /tmp/prof && tar czf $OUT/prof.tgz *.sass.csv *.details.txt *.log
