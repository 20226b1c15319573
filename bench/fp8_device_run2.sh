#!/bin/bash
# Second device call: the API's new FP8 default (fragments) end to end, the 16-bit decode and paged
# GPU tests (the shared chunk_offset / combine edits), and the top FP8 variants timed again (noise).
# Usage (repository root): bash bench/fp8_device_run2.sh OUT_JSON_NAME
set -u
export PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -m gpu -q -n 12 -p no:cacheprovider tests/test_gpu_fp8_decode.py -k "api" > $OUT/api.log 2>&1
echo "api rc=$?" >> $OUT/api.log; tail -3 $OUT/api.log
timeout 80 python3 bench/fp8_decode_bench.py $OUT/$1 --variants spec,fr_kv128_s1,fr_kv256_s1,fr_kv128_s1_mb3 > $OUT/bench.log 2>&1
echo "bench rc=$?" >> $OUT/bench.log; tail -10 $OUT/bench.log
timeout 110 python3 -m pytest -m gpu -q -n 14 -p no:cacheprovider tests/test_gpu_decode.py tests/test_gpu_paged.py > $OUT/decode16.log 2>&1
echo "decode16 rc=$?" >> $OUT/decode16.log; tail -4 $OUT/decode16.log
