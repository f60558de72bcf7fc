#!/usr/bin/env bash
# Set up everything this project needs, idempotently: a virtualenv in .venv with the CPU build of torch
# first (so nothing pulls a multi-GB CUDA build), then the project with its worker and dev extras.
# Override the torch requirement with TORCH_SPEC (e.g. TORCH_SPEC='torch>=2.6' on a GPU host).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v '^WARNING: Location' || true
fi
.venv/bin/python -m pip install -q -e '.[worker,dev]' 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c 'import torch, transformers, safetensors, hsextract; print(f"set up: torch {torch.__version__}, transformers {transformers.__version__}, hsextract {hsextract.__version__}")'
