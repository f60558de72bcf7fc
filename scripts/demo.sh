#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: a tiny model and dataset built here, every shard
# through the real worker CLI, output to local storage, read back and verified. Extra args go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hsextract demo "$@"
