# Sourced on the device (`source bench/device_setup.sh`, carry [".whl", ".carry"]): the wheels, tiledsl, the cubin
# cache carried from the last call, one BLAS thread per test worker.
# The cubin cache travels as xz parts: save_cache writes $OUT/cache.part.*, which the next call carries in .carry/
# (ignored by git), so kernels whose source did not change are not compiled again.
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site TILEDSL_CACHE_DIR=/tmp/tcache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p /tmp/tcache && [ -e .carry/cache.part.aa ] && cat .carry/cache.part.* | xz -d | tar -C /tmp/tcache -xf - && echo "cache: $(ls /tmp/tcache/cubin | wc -l) cubins"
save_cache() { tar -C /tmp/tcache -cf - cubin | xz -T16 -1 > /tmp/cache.tar.xz; split -b 15M /tmp/cache.tar.xz $OUT/cache.part.; }
# gpu_tests NAME SECONDS FILES...: pytest -v on 15 workers into $OUT/NAME.log, SIGINT at the limit (the per-test
# PASSED lines say what ran; xdist may then print no durations, so $OUT/NAME.times has each finished test's seconds).
# With pytest-timeout's wheel in .whl, a test past TEST_TIMEOUT seconds (300) kills its worker: a hung kernel shows up
# as that test's failure instead of holding a worker to the end.
gpu_tests() { local name=$1 limit=$2; shift 2; (cd tests && TILEDSL_TEST_TIMES=$OUT/$name.times \
  timeout -s INT $limit python3 -m pytest -v -m gpu -n 15 $(python3 -c 'import pytest_timeout' 2>/dev/null && echo \
  --timeout=${TEST_TIMEOUT:-300} --timeout-method=thread) \
  -p no:cacheprovider "$@" -rf --durations=20 2>&1 | grep -v "PytestBenchmarkWarning\|warner(" > $OUT/$name.log);
  grep -E "^(FAILED|ERROR)|passed|failed" $OUT/$name.log | tail -25; }
