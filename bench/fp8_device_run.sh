#!/bin/bash
# One device call for the FP8 fragments work: GPU tests of both conversion paths, the benchmark of
# every fragments variant next to the shared default and bf16 KV, then compute-sanitizer. Each step
# under `timeout`; logs and JSON under $OUT. Usage (repository root): bash bench/fp8_device_run.sh OUT_JSON_NAME
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt 2>&1
timeout 170 python3 -m pytest -m gpu -q -n 12 --maxfail=30 -p no:cacheprovider tests/test_gpu_fp8_decode.py \
    -k "not memcheck" > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/tests.log; tail -4 $OUT/tests.log
VARIANTS=spec,kv64_s4,fr_kv128_s1,fr_kv128_s2,fr_kv128_s3,fr_kv64_s2,fr_kv64_s4,fr_kv256_s1,fr_kv256_s2_w8,fr_kv128_s1_mb3,fr_kv64_s2_mb3
timeout 200 python3 bench/fp8_decode_bench.py $OUT/$1 --variants $VARIANTS > $OUT/bench.log 2>&1
echo "bench rc=$?" >> $OUT/bench.log; tail -25 $OUT/bench.log
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_fp8_decode.py -k memcheck > $OUT/memcheck.log 2>&1
echo "memcheck rc=$?" >> $OUT/memcheck.log; tail -3 $OUT/memcheck.log
