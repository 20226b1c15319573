#!/bin/bash
# Third device call: every fragments GPU test after Q-from-shared for large head dims (and the
# mma_qk_fp8 refactor it needed), the API tests, and the default re-timed next to bf16 and shared.
# Usage (repository root): bash bench/fp8_device_run3.sh OUT_JSON_NAME
set -u
export PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -m gpu -q -n 14 -p no:cacheprovider tests/test_gpu_fp8_decode.py -k "fragments or api" > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log; tail -4 $OUT/tests.log
timeout 70 python3 bench/fp8_decode_bench.py $OUT/$1 --variants spec,fr_kv128_s1,fr_kv256_s1 > $OUT/bench.log 2>&1
echo "bench rc=$?" >> $OUT/bench.log; tail -10 $OUT/bench.log
