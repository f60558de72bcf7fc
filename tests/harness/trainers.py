"""The drafter trainers' own packages, in an environment of their own, for the export tests.

SpecForge 0.2.0 and speculators 0.9.0 pin other torch/transformers versions than ours (and SpecForge pulls a
whole serving stack), so they are installed into a separate venv with only what the loaders used here import
(SpecForge's offline readers import torch only; speculators imports transformers, datasets, openai,
hs-connectors at import time). The venv is built once and kept (default `~/.cache/hsextract/trainers-<hash
of the requirements>`, or `$HSX_TRAINERS_VENV`); the consumer script `trainer_load.py` runs there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

#: the trainers themselves, without their dependency lists (SpecForge's: sglang, wandb, a CUDA torch pin)
NO_DEPS = ["specforge==0.2.0", "speculators==0.9.0", "hs-connectors==0.9.0"]
#: what their loaders and speculators' EAGLE-3 draft import; versions inside speculators' own ranges
DEPS = ["torch==2.13.0", "transformers>=5,<=5.19.0", "datasets>=4,<=5.1.0", "pydantic>=2", "openai>=2",
        "safetensors", "huggingface_hub", "loguru>=0.7.2,<=0.7.3", "numpy>=2,<=2.5.4"]
CONSUMER = Path(__file__).with_name("trainer_load.py")


def venv_dir() -> Path:
    key = hashlib.sha256(json.dumps([NO_DEPS, DEPS, sys.version_info[:2]]).encode()).hexdigest()[:12]
    default = Path.home() / ".cache" / "hsextract" / f"trainers-{key}"
    return Path(os.environ.get("HSX_TRAINERS_VENV", default))


def trainers_python() -> Path:
    """The venv's python, building the venv first when it is not there (about a minute, 1.5 GB)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for step in ([DEPS[0]], ["--no-deps", *NO_DEPS], DEPS[1:]):  # torch first: the CPU build on this disk
        done = subprocess.run(pip + step, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(step)} into {venv} failed:\n{done.stdout}\n{done.stderr}")
    (venv / ".complete").write_text(json.dumps({"no_deps": NO_DEPS, "deps": DEPS}))
    return python


def load_with_trainer(fmt: str, dest: Path, out: Path, max_len: int, *extra: str,
                      timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `trainer_load.py FORMAT DEST OUT --max-len N` with the trainers' python; raises with its output."""
    done = subprocess.run([str(trainers_python()), str(CONSUMER), fmt, str(dest), str(out), "--max-len",
                           str(max_len), *extra], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ""})
    if done.returncode != 0:
        raise AssertionError(f"{CONSUMER.name} {fmt} {dest} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done
