#!/usr/bin/env bash
# Set up, lint and type-check (scripts/lint.sh), then run the whole test suite (unit + integration on a real tiny
# model): the tests in parallel (pytest-xdist, one process per file's tests so module fixtures are built once),
# then the `serial` ones after it, beside each other only (timing-sensitive under the parallel run's load). Extra
# args go to both pytest runs; HSX_TEST_WORKERS sets the parallel processes (default 3: on 2 cores the tests
# spend much of their time waiting on subprocesses). The parallel run ends with its 20 slowest tests and its 12
# longest files (--durations): where the suite's time goes.
# The fast tier alone: .venv/bin/python -m pytest -m 'not slow' -q
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh
status=0
phase() {  # one pytest run; "no tests collected" (5: a selection with none of this phase's tests) is no failure
  local rc=0
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}
phase -m "not serial" -n "${HSX_TEST_WORKERS:-3}" --dist loadfile --durations=20 "$@"
phase -m serial -n 3 --dist load "$@"  # beside each other only: they wait far more than they compute
exit $status
