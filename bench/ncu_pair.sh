#!/bin/bash
# Temporary (not committed): ncu full-set profiles of named attention calls, SASS csv + details under $OUT.
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
