"""A CPU proxy for a launch-bound forward beside the worker's host threads: how much slower does one thread that
issues many small torch ops get when other threads of the same process hash, or wake often?

    .venv/bin/python benchmarks/launch_contention.py [--ops 1500] [--seconds 4]

One "forward" is `--ops` tiny CPU tensor additions (the dispatcher's cost dominates, as a CUDA launch's does on a
GPU host). Its rate is timed alone, then beside each load: one thread hashing a 64 MiB buffer in one update (the
worker hashes whole tensors like this), the same in 1 MiB and in 64 KiB updates (more returns to Python, more
GIL hand-overs), and four threads waking every millisecond. Each load's rate is the ratio to the alone timing
just before it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=1500)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.ones(16)
    buffer = os.urandom(64 << 20)

    def forward() -> None:
        y = x
        for _ in range(args.ops):
            y = y + 1.0

    def rate() -> float:
        forward()
        n, began = 0, time.perf_counter()
        while time.perf_counter() - began < args.seconds:
            forward()
            n += 1
        return n / (time.perf_counter() - began)

    def hasher(stop: threading.Event, step: int) -> None:
        view = memoryview(buffer)
        while not stop.is_set():
            digest = hashlib.sha256()
            for i in range(0, len(buffer), step):
                digest.update(view[i:i + step])

    def waker(stop: threading.Event) -> None:
        while not stop.is_set():
            time.sleep(0.001)

    loads = {"one thread hashing 64 MiB in one update": [(hasher, (64 << 20,))],
             "one thread hashing in 1 MiB updates": [(hasher, (1 << 20,))],
             "one thread hashing in 64 KiB updates": [(hasher, (64 << 10,))],
             "four threads waking every millisecond": [(waker, ())] * 4}
    print(f"{os.cpu_count()} cores, switch interval {sys.getswitchinterval() * 1e3:.0f} ms, {args.ops} ops a forward")
    for name, jobs in loads.items():
        alone = rate()
        stop = threading.Event()
        threads = [threading.Thread(target=job, args=(stop, *extra)) for job, extra in jobs]
        for t in threads:
            t.start()
        loaded = rate()
        stop.set()
        for t in threads:
            t.join()
        print(f"{name:<42} alone {alone:7.1f} forwards/s, beside it {loaded:7.1f}: {loaded / alone:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
