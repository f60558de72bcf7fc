#!/usr/bin/env bash
# Set up, then run the whole test suite (unit + integration on a real tiny model). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
