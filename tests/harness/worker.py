"""The real worker CLI (`python -m hsextract extract`) as a subprocess, and what it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def extract_cmd(model: Path, data: Path, out: Path, shard: int, num_shards: int, *extra: str,
                layers: str = "1,3,6", module: str = "hsextract") -> list[str]:
    """`python -m hsextract extract ...` (or `-m harness.faulty` for a worker with injected faults)."""
    return [sys.executable, "-m", module, "extract", "--model", str(model), "--data", str(data),
            "--out", str(out), "--layers", layers, "--shard", str(shard), "--num-shards", str(num_shards),
            "--heartbeat-interval", "0.2", *extra]


def run_extract(*args, env: dict | None = None, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `hsextract extract` to the end; returns the completed process (stdout/stderr as text)."""
    return subprocess.run(extract_cmd(*args, **kwargs), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def summary_of(proc: subprocess.CompletedProcess) -> dict:
    lines = [l for l in proc.stdout.splitlines() if l.startswith("SUMMARY ")]
    assert lines, f"no SUMMARY line (rc={proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(lines[-1].removeprefix("SUMMARY "))


def dataset_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after its command name: [0] the state letter, [19] the start time (what the
    orchestrator records as pid.start)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()


def running(pid: int) -> bool:
    """The process exists and is not a zombie (nobody here reaps the workers' orphans: a zombie has ended)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return False
