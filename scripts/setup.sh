#!/usr/bin/env bash
# Set up everything this project needs, idempotently: a virtualenv in .venv with the CPU build of torch
# first (so nothing pulls a multi-GB CUDA build), then the project with all its extras, plus the
# system packages the tests need (openssh-server, iproute2, chromium for the UI test, libfaketime) when run as root on
# Debian/Ubuntu.
# Override the torch requirement with TORCH_SPEC (e.g. TORCH_SPEC='torch>=2.6' on a GPU host).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# System packages the tests use (a real sshd per test host, network namespaces as extra hosts, a headless
# browser that renders the Prefect UI).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=""
  [ -x /usr/sbin/sshd ] || missing="$missing openssh-server"
  command -v sftp >/dev/null || missing="$missing openssh-client"  # staging sends orchestrator: inputs with it
  command -v ip >/dev/null || missing="$missing iproute2"
  command -v flock >/dev/null || missing="$missing util-linux"
  [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || [ "$(uname -m)" != x86_64 ] \
    || missing="$missing libfaketime"  # the preflight test's host whose clock is off
  command -v chromium >/dev/null || missing="$missing chromium fonts-liberation"  # the UI test's browser
  if [ -n "$missing" ]; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
# pip installs without compiling; the bytecode is made here, torch's on the other core while pip installs the rest
# (most of a set-up's time; every later process loads it instead of compiling the sources again)
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
installed_before=$(ls "$site")
compile() { .venv/bin/python -m compileall -qq "$@" >/dev/null 2>&1 || true; }  # errors: py2-only test files
torch_compiled=""
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q --no-compile "${TORCH_SPEC:-torch==2.13.0}" 2>&1 \
    | grep -v '^WARNING: Location' || true
  compile "$site/torch" "$site/functorch" "$site/torchgen" &
  torch_compiled=$!
fi
.venv/bin/python -m pip install -qq --no-compile -e '.[worker,orchestrate,export,dev]' 2>&1 \
  | grep -v '^WARNING: Location' || true
if [ -n "$torch_compiled" ]; then wait "$torch_compiled"; fi
if [ "$(ls "$site")" != "$installed_before" ]; then  # something installed or upgraded: compile what is not yet
  mapfile -t entries < <(ls -d "$site"/*/ | grep -v '/transformers/$')  # torch's: checked, compiled already
  compile "$site/transformers" &  # the largest of the rest: one process, everything else the other
  compile "${entries[@]}"
  .venv/bin/python -m compileall -qq -l "$site" >/dev/null 2>&1 || true  # its top-level modules
  wait
fi
.venv/bin/python -c 'import torch, transformers, safetensors, hsextract; import prefect, fabric; print(f"set up: torch {torch.__version__}, transformers {transformers.__version__}, prefect {prefect.__version__}, hsextract {hsextract.__version__}")'
