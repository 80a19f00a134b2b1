#!/usr/bin/env bash
# One batched GPU session (device tool): the test files given in $TESTS (PYTEST_ARGS="-m gpu"
# for the real shapes only), then benchmark commands given one per line in $BENCHES. Logs and
# result files land in $OUT (at most 8 files come back: keep the lists short).
set -u
# results (stable names, one history.csv) go to $OUT; bring them into the repo with
#   python bench/record.py <files_at>/*.json     (copies them into bench/results, appends history)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 FORGE_BENCH_OUT=$OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# DEADLINE (seconds, optional): start no further item once this much wall time has passed
start=$SECONDS
late() { [ -n "${DEADLINE:-}" ] && [ $((SECONDS - start)) -ge "$DEADLINE" ] && echo "skipped (past DEADLINE): $1"; }
python3 -c "import pytest_timeout" 2>/dev/null && PT="--timeout 240" || PT=""
# one test file per line of $TESTS, optionally followed by its own pytest arguments in shell
# syntax (-k "pallas or generate"); each line gets its own time limit, so one slow file cannot
# starve the others
i=0
while read -r t extra; do
  [ -z "$t" ] && continue
  tmo=${TEST_TIMEOUT:-300}
  case "$t" in @*) tmo=${t#@}; read -r t extra <<< "$extra";; esac  # "@120 tests/x.py ...": its own limit
  late "$t $extra" && continue
  i=$((i + 1))
  name=$(basename "$t" .py)-$i
  eval "set -- $extra"
  timeout "$tmo" python3 -m pytest "$t" -q -p no:cacheprovider $PT -rfE --tb=short \
    ${PYTEST_ARGS:-} "$@" > "$OUT/pytest-$name.log" 2>&1 < /dev/null
  echo "$t $extra: rc=$? $(grep -E '(passed|failed|skipped)' "$OUT/pytest-$name.log" | tail -1)"
  grep -E "^FAILED|^ERROR" "$OUT/pytest-$name.log" | head -10
done <<< "${TESTS:-}"
while IFS= read -r cmd; do
  [ -z "$cmd" ] && continue
  late "$cmd" && continue
  echo "== $cmd"
  timeout "${BENCH_TIMEOUT:-150}" bash -c "$cmd" 2>&1 < /dev/null | tail -40  # (no progress bars off a terminal)
done <<< "${BENCHES:-}"
