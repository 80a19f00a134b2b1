#!/usr/bin/env bash
# One batched GPU session (device tool): the gpu test files given in $TESTS, then benchmark
# commands given one per line in $BENCHES. Logs and result files land in $OUT.
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 FORGE_BENCH_RESULTS=$OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest $TESTS -q -p no:cacheprovider --timeout 240 -rfE ${PYTEST_ARGS:-} > $OUT/pytest.log 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/pytest.log | tail -25
fi
while IFS= read -r cmd; do
  [ -z "$cmd" ] && continue
  echo "== $cmd"
  timeout "${BENCH_TIMEOUT:-150}" bash -c "$cmd" 2>&1 | grep -v "it/s\]" | tail -40
done <<< "${BENCHES:-}"
