#!/usr/bin/env bash
# Set up, then the quality gate and the whole test suite (unit + integration on a real tiny model): ruff's lint,
# then the tests in parallel (pytest-xdist, one process per file's tests so module fixtures are built once; the
# longest files first, tests/conftest.py's LONGEST_FIRST) with mypy's type check beside them. Any of the three
# failing fails the run. Extra args go to pytest; HSX_TEST_WORKERS sets the processes (default 3: on 2 cores the
# tests spend much of their time waiting on subprocesses). The run ends with its 20 slowest tests and its 12
# longest files (--durations): where the suite's time goes.
# The gate alone: bash scripts/lint.sh. The fast tier alone: .venv/bin/python -m pytest -m 'not slow' -q
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
.venv/bin/ruff check || status=$?
types=$(mktemp)
.venv/bin/python -m mypy > "$types" 2>&1 &
mypy_pid=$!
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${HSX_TEST_WORKERS:-3}" --dist loadfile \
  --no-loadscope-reorder --durations=20 "$@" || status=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
cat "$types"
rm -f "$types"
if [ "$mypy_rc" -ne 0 ]; then status=$mypy_rc; fi
exit $status
