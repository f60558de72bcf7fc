#!/usr/bin/env bash
# Set up, lint (scripts/lint.sh), then run the whole test suite (unit + integration on a real tiny model). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
