"""When the suite's run keeps the cores busy, and with what: a timeline in 30-second bins.

It runs the tests as `scripts/test.sh` does (no set-up, no lint; extra pytest args after `--`), with a
small plugin on the xdist controller recording when each test's set-up, call and tear-down ended and on which
process, while this script samples /proc/stat every 2 s. Printed: per bin, the cores busy on average (2.00 on a
2-core machine is saturated) and the test each xdist process was running in the bin's middle; then when each
process ran out of work. A run busy to the end is CPU-bound (only less CPU shortens it); a tail with idle
cores is a schedule's (the order in which files are handed out).

    .venv/bin/python benchmarks/suite_timeline.py [--workers 3] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from suite_cpu import suite_args

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = '''import json, os, time
def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)
    if node is None:
        return  # a worker's own report: the controller records it
    with open(os.environ["HSX_TIMELINE"], "a") as f:
        f.write(json.dumps({"t": time.time(), "w": node.gateway.id, "id": report.nodeid, "d": report.duration}) + "\\n")
'''
BIN_S = 30


def cpu_times() -> tuple[int, int]:
    """(busy, idle) jiffies of all cores since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values[:3]) + sum(values[5:8]), values[3] + values[4]


def sample(samples: list, stop: threading.Event) -> None:
    while not stop.is_set():
        samples.append((time.time(), *cpu_times()))
        stop.wait(2.0)


def short(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    return f"{Path(path).name}::{name[:40]}"


def report(started: float, ended: float, samples: list, events: list[dict]) -> None:
    cores = os.cpu_count() or 1
    bins: dict[int, list[float]] = collections.defaultdict(list)
    for (t0, busy0, idle0), (_, busy1, idle1) in zip(samples, samples[1:]):
        if started <= t0 <= ended:
            busy, idle = busy1 - busy0, idle1 - idle0
            bins[int((t0 - started) // BIN_S)].append(cores * busy / max(1, busy + idle))
    spans: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in events:
        end = e["t"] - started
        spans[e["w"]].append((end - e["d"], end, e["id"]))
    workers = sorted(spans)
    print(f"| from | cores busy (of {cores}) | " + " | ".join(workers) + " |")
    print("|---|---|" + "---|" * len(workers))
    for b in sorted(bins):
        middle = b * BIN_S + BIN_S / 2
        running = [next((short(i) for s, e, i in spans[w] if s <= middle <= e), "-") for w in workers]
        print(f"| {b * BIN_S} s | {sum(bins[b]) / len(bins[b]):.2f} | " + " | ".join(running) + " |")
    busy = [u for values in bins.values() for u in values]
    print(f"\nthe run: {ended - started:.0f} s, {sum(busy) / max(1, len(busy)):.2f} cores busy on average; "
          "each process out of work at: "
          + ", ".join(f"{w} {max(e for _, e, _ in spans[w]):.0f} s" for w in workers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=int(os.environ.get("HSX_TEST_WORKERS", "3")))
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hsx-timeline-") as tmp:
        (Path(tmp) / "hsx_timeline_plugin.py").write_text(PLUGIN)
        record = Path(tmp) / "events.jsonl"
        env = {**os.environ, "HSX_TIMELINE": str(record),
               "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        samples: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(samples, stop), daemon=True)
        sampler.start()
        started = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                               "hsx_timeline_plugin", *suite_args(args.workers), *args.pytest_args], cwd=ROOT, env=env)
        ended = time.time()
        stop.set()
        sampler.join()
        events = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    report(started, ended, samples, events)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
