#!/usr/bin/env bash
# The quality gate alone (scripts/test.sh runs it before the tests): ruff's lint rules, then mypy's type check,
# on the product, as pyproject.toml's [tool.ruff] and [tool.mypy] set them. `bash scripts/lint.sh --fix` applies
# the fixes ruff can make.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check "$@"
.venv/bin/python -m mypy
