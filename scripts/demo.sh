#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: a tiny model and dataset built here, the Prefect
# flow `extract` over the local host (two slots), output to local storage, verified. Extra args go to
# deployments/demo.py (e.g. --hosts inventory.yaml to run on SSH hosts instead).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_LOGGING_LEVEL=${PREFECT_LOGGING_LEVEL:-INFO}
exec .venv/bin/python -m deployments.demo "$@"
