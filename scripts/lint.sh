#!/usr/bin/env bash
# The quality gate alone: ruff's lint rules, then mypy's type check, on the product, as pyproject.toml's
# [tool.ruff] and [tool.mypy] set them (scripts/test.sh runs the same two: ruff first, mypy beside the
# tests). `bash scripts/lint.sh --fix` applies the fixes ruff can make.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check "$@"
.venv/bin/python -m mypy
