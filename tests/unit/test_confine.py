"""Landlock confinement of a worker's writes (hsextract.run.confine): which dirs, and the kernel really refusing.

Restricting is irreversible for a process, so the real checks run in a child interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hsextract.run.confine import confine, landlock_abi, writable_dirs



def test_shared_places_are_writable_only_when_they_hold_no_other_shard(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "w" / "runs" / "r"
    own = [out / "shard-00000-of-00002", runs / "shard-00000-of-00002"]
    env = {"HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path)}  # the temp dir holds the output
    allowed, tmp = writable_dirs(own, [out, runs], env)
    assert tmp == own[-1] / "tmp", "a private temp dir, since the shared one holds the other shards"
    assert allowed[:2] == own and tmp in allowed and tmp_path not in allowed
    assert tmp_path / "home" / ".cache" in allowed and tmp_path / "home" / ".triton" in allowed
    assert not any(p == out or p == runs or out.is_relative_to(p) for p in allowed if p not in own + [tmp]
                   and p not in (Path("/dev"), Path("/proc")))
    elsewhere = tmp_path / "scratch"
    elsewhere.mkdir()
    _, tmp = writable_dirs(own, [out, runs], {**env, "TMPDIR": str(elsewhere)})
    assert tmp == elsewhere, "a temp dir that holds no shard is shared as usual"
    allowed, _ = writable_dirs(own, [out, runs], {**env, "HOME": str(tmp_path)})
    assert tmp_path / ".cache" in allowed and tmp_path not in allowed


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="confine mode 'maybe'"):
        confine([], [], "maybe")


CHILD = r"""
import json, os, subprocess, sys, threading
from pathlib import Path
from hsextract.run.confine import confine
root = Path(sys.argv[1])
mode = sys.argv[2]
done = confine([root / "out/shard-0", root / "runs/shard-0"], [root / "out", root / "runs"], mode)
result = {"active": done.active, "describe": done.describe(), "tmpdir": os.environ.get("TMPDIR")}
def attempt(path):
    try:
        with open(path, "a") as handle:
            handle.write("x")
        return "written"
    except OSError as exc:
        return exc.strerror
for name in ("out/shard-0/f", "runs/shard-0/f", "out/shard-1/f", "runs/shard-1/f", "out/f", "f"):
    result[name] = attempt(root / name)
box = {}
thread = threading.Thread(target=lambda: box.update(thread=attempt(root / "out/shard-1/t")))
thread.start(); thread.join()
result["thread"] = box["thread"]
result["child"] = subprocess.run(["sh", "-c", f"echo x > {root}/out/shard-1/sh"], capture_output=True).returncode
print(json.dumps(result))
"""


def run_child(tmp_path: Path, mode: str) -> dict:
    for d in ("out/shard-0", "out/shard-1", "runs/shard-0", "runs/shard-1"):
        (tmp_path / d).mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), mode], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_confined_process_writes_only_beneath_its_own_dirs(tmp_path):
    assert landlock_abi() >= 1, "this kernel has no Landlock: the worker would run unconfined"
    seen = run_child(tmp_path, "on")
    assert seen["active"] and "Landlock ABI" in seen["describe"]
    assert seen["out/shard-0/f"] == seen["runs/shard-0/f"] == "written"
    for other in ("out/shard-1/f", "runs/shard-1/f", "out/f", "f", "thread"):
        assert seen[other] == "Permission denied", (other, seen)
    assert seen["child"] != 0, "a child process inherits the restriction"
    assert seen["tmpdir"] == str(tmp_path / "runs/shard-0/tmp") and (tmp_path / "runs/shard-0/tmp").is_dir()


def test_off_leaves_the_process_alone(tmp_path):
    seen = run_child(tmp_path, "off")
    assert not seen["active"] and seen["describe"] == "writes NOT confined: --confine off"
    assert seen["out/shard-1/f"] == "written"
