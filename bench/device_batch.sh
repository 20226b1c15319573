#!/bin/bash
# One device call of the lead's GPU batch (the device README's pattern): install, then run step $1.
#   bash bench/device_batch.sh suite|kernels|all-tests|benches    (writes logs and results under $OUT)
set -u
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1   # compute-sanitizer for the sanitizer tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
case "$1" in
suite)
  timeout 330 python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider \
    --ignore=tests/test_gpu_backward_ws.py --ignore=tests/test_gpu_tile_scheduler.py > $OUT/gpu-suite.log 2>&1
  echo "suite rc=$?"; tail -25 $OUT/gpu-suite.log
  timeout 70 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_tile_scheduler.py \
    -k "not sanitizer" > $OUT/gpu-tile-scheduler.log 2>&1
  echo "tile scheduler rc=$?"; tail -5 $OUT/gpu-tile-scheduler.log
  timeout 150 python3 bench/prefill_ab.py $OUT/prefill-ab.json --no-model-shapes --seqlens 1024 4096 16384 --rep-ms 25 > $OUT/prefill-ab.log 2>&1
  echo "prefill_ab rc=$?"; tail -30 $OUT/prefill-ab.log ;;
kernels)
  timeout 300 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider tests/test_gpu_backward_ws.py \
    -k "not sanitizer" > $OUT/gpu-backward-ws.log 2>&1
  echo "backward ws rc=$?"; tail -20 $OUT/gpu-backward-ws.log
  timeout 240 python3 bench/backward_ws_bench.py $OUT/backward-ws-bench.json > $OUT/backward-ws-bench.log 2>&1
  echo "bench rc=$?"; tail -30 $OUT/backward-ws-bench.log ;;
all-tests)
  # every GPU test file in one run, sanitizers included
  timeout 520 python3 -m pytest -q -m gpu -n 14 -p no:cacheprovider > $OUT/gpu-all.log 2>&1
  echo "all gpu tests rc=$?"; grep -E "passed|failed|error" $OUT/gpu-all.log | tail -5; grep -E "^(FAILED|ERROR)" $OUT/gpu-all.log | head -40 ;;
benches)
  timeout 150 python3 bench/launch_bench.py $OUT/launch.json > $OUT/launch.log 2>&1
  echo "launch rc=$?"; grep -E "'api': '(attention|attention_decode|paged_attention|paged_run|varlen_attention|fwd_bwd)'" $OUT/launch.log | cut -c1-260
  for b in ${BENCHES:-}; do
    timeout 200 python3 bench/$b.py $OUT/$b.json > $OUT/$b.log 2>&1; echo "$b rc=$?"; tail -25 $OUT/$b.log
  done ;;
esac
