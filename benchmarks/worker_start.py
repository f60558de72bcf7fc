"""A worker's start: process start to its first batch file journaled, on chat records (tokenized by the worker).

    .venv/bin/python benchmarks/worker_start.py [--samples 1100] [--words 150] [--runs 3] [--hidden 64] [--device cpu]

Builds a tiny Qwen3.5 hybrid (8 layers of `--hidden`; 2048 makes a 1.1 GB checkpoint, whose load is mostly
copying with the GIL released, as a real checkpoint's is) and a chat dataset of `--samples` conversations
(`--words` words a turn: ~840 tokens each at 150), then runs `hsextract extract` over it `--runs` times, each
into a fresh output, and stops each worker (SIGTERM) once its first batch file is journaled. Prints per run
that file's time after the process started and the model's load (from the worker's log). The first window
of records (1024 by default) is what the worker tokenizes before its first batch: since issue 20 on a thread
while the model loads (`EarlyTokens`); run it on an older commit for the figure before.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hsextract import tiny

ROOT = Path(__file__).resolve().parent.parent


def one_run(model: Path, data: Path, out: Path, device: str) -> dict:
    cmd = [sys.executable, "-m", "hsextract", "extract", "--model", str(model), "--data", str(data), "--out",
           str(out), "--layers", "1,3", "--shard", "0", "--num-shards", "1", "--device", device, "--progress", "log",
           "--max-length", "4096"]
    began = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    first = None
    while first is None and proc.poll() is None:
        time.sleep(0.02)
        for journal in out.glob("shard-*/journal.jsonl"):
            entries = [json.loads(line) for line in journal.read_text().splitlines() if line.endswith("}")]
            first = min((e["time"] for e in entries if e.get("kind") == "file"), default=None)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    if first is None:
        raise SystemExit(f"no batch file (rc {proc.returncode}):\n{err[-3000:]}")
    load = re.search(r"model loaded in ([0-9.]+)s", err)
    return {"first_file_s": first - began, "load_s": float(load.group(1)) if load else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1100)
    ap.add_argument("--words", type=int, default=150)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-start-"))
    try:
        model = tiny.build_model(work / "model", hidden_size=args.hidden)
        data = tiny.build_dataset(work / "chat.jsonl", args.samples, seed=1, words_per_turn=args.words)
        runs = []
        for i in range(args.runs):
            runs.append(one_run(model, data, work / f"out-{i}", args.device))
            print(f"run {i + 1}: first file {runs[-1]['first_file_s']:.2f} s after the start (model loaded in "
                  f"{runs[-1]['load_s']} s)", flush=True)
        print(f"median first file {statistics.median(r['first_file_s'] for r in runs):.2f} s after the start over "
              f"{args.runs} runs ({args.samples} chat samples, {args.words} words a turn, hidden {args.hidden}, device "
              f"{args.device})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
