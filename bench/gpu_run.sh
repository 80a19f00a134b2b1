#!/usr/bin/env bash
# One batched GPU session (device tool): the test files given in $TESTS (PYTEST_ARGS="-m gpu"
# for the real shapes only), then benchmark commands given one per line in $BENCHES. Logs and
# result files land in $OUT (at most 8 files come back: keep the lists short).
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 FORGE_BENCH_RESULTS=$OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# each test file gets its own time limit, so one slow file cannot starve the others
for t in ${TESTS:-}; do
  name=$(basename "$t" .py)
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest "$t" -q -p no:cacheprovider --timeout 240 -rfE --tb=short \
    ${PYTEST_ARGS:-} > "$OUT/pytest-$name.log" 2>&1
  echo "$t: rc=$? $(grep -E '(passed|failed)' "$OUT/pytest-$name.log" | tail -1)"
  grep -E "^FAILED|^ERROR" "$OUT/pytest-$name.log" | head -10
done
while IFS= read -r cmd; do
  [ -z "$cmd" ] && continue
  echo "== $cmd"
  timeout "${BENCH_TIMEOUT:-150}" bash -c "$cmd" 2>&1 | grep -v "it/s\]" | tail -40
done <<< "${BENCHES:-}"
