#!/bin/bash
# One device call of the lead's GPU batch (the device README's pattern): install, then run step $1.
#   bash bench/device_batch.sh suite|kernels    (writes logs and results under $OUT)
set -u
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
esac
