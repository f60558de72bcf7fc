"""The import boundary, at runtime: every module of each side is imported in a fresh interpreter, and what got
loaded is checked. The worker (what runs on GPU hosts) loads no orchestration package; the orchestrator
(flows, tasks, deployments: what runs where Prefect runs) loads no torch-side package. And no package's
modules import each other in a circle, or take another module's private names (benchmarks/code_shape.py)."""

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
    assert {"hsextract.run.extract", "hsextract.store", "hsextract.training.reader", "hsextract.cli"} <= set(names), names
    loaded = loaded_after_importing(names)
    assert "torch" in loaded, "the worker's modules were really imported"
    assert not loaded & ORCHESTRATION, sorted(loaded & ORCHESTRATION)


def test_the_orchestrator_loads_no_torch_side_package():
    names = [n for package in ("flows", "tasks", "deployments") for n in modules(package, ROOT / package)]
    assert {"flows.extract", "tasks.plan", "tasks.shards", "deployments.qwen"} <= set(names), names
    loaded = loaded_after_importing(names)
    assert {"prefect", "paramiko", "hsextract"} <= loaded, "the orchestrator's modules were really imported"
    assert not loaded & TORCH_SIDE, sorted(loaded & TORCH_SIDE)


def code_shape(root: Path, out: Path) -> dict:
    """benchmarks/code_shape.py's measures of the checkout at `root` (lint and type tools not run)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "code_shape.py"), "--root", str(root),
                           "--no-tools", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_no_module_imports_in_a_circle_or_takes_a_private_name(tmp_path):
    shape = code_shape(ROOT, tmp_path / "shape.json")
    assert shape["cycles"] == [], shape["cycles"]
    assert shape["private_imports"] == [], shape["private_imports"]
    assert shape["syspath"] == [], shape["syspath"]


def test_the_measure_finds_a_circle_and_a_private_name(tmp_path):
    """The check above can fail: a lazy import closing a circle, and a private name, are found."""
    package = tmp_path / "src" / "hsextract"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import helper\n\n\ndef _private():\n    return helper\n")
    (package / "b.py").write_text("def helper():\n    from .a import _private\n    return _private\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    for part in ("tasks", "flows", "deployments"):
        (tmp_path / part).mkdir()
    shape = code_shape(tmp_path, tmp_path / "shape.json")
    assert shape["cycles"] == [["hsextract.a", "hsextract.b"]]
    assert [p.split(" ")[1] for p in shape["private_imports"]] == ["hsextract.a._private"]
