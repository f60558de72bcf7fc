"""The import boundary, at runtime: every module of each side is imported in a fresh interpreter, and what got
loaded is checked. The worker (what runs on GPU hosts) loads no orchestration package; the orchestrator
(flows, tasks, deployments: what runs where Prefect runs) loads no torch-side package."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORCHESTRATION = {"prefect", "prefect_aws", "fabric", "paramiko", "invoke"}
TORCH_SIDE = {"torch", "transformers", "safetensors", "tokenizers"}


def modules(package: str, directory: Path) -> list[str]:
    """Every module of a package by name, but `__main__` (importing it runs the program)."""
    names = [package]
    for info in pkgutil.walk_packages([str(directory)], prefix=f"{package}."):
        if not info.name.endswith(".__main__"):
            names.append(info.name)
    return names


def loaded_after_importing(names: list[str]) -> set[str]:
    """Top-level packages in sys.modules after importing `names` in a new interpreter."""
    code = ("import importlib, json, sys\n"
            "for name in json.loads(sys.argv[1]):\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(names)], capture_output=True, text=True,
                         timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_worker_loads_no_orchestration_package():
    names = modules("hsextract", ROOT / "src" / "hsextract")
    assert {"hsextract.extract", "hsextract.store", "hsextract.reader", "hsextract.cli"} <= set(names), names
    loaded = loaded_after_importing(names)
    assert "torch" in loaded, "the worker's modules were really imported"
    assert not loaded & ORCHESTRATION, sorted(loaded & ORCHESTRATION)


def test_the_orchestrator_loads_no_torch_side_package():
    names = [n for package in ("flows", "tasks", "deployments") for n in modules(package, ROOT / package)]
    assert {"flows.extract", "tasks.plan", "tasks.shards", "deployments.qwen"} <= set(names), names
    loaded = loaded_after_importing(names)
    assert {"prefect", "paramiko", "hsextract"} <= loaded, "the orchestrator's modules were really imported"
    assert not loaded & TORCH_SIDE, sorted(loaded & TORCH_SIDE)
