"""A worker's start: process start to its first batch file journaled, on chat records (tokenized by the worker).

    .venv/bin/python benchmarks/worker_start.py [--samples 1100] [--words 150] [--runs 3] [--device cpu]

Builds the tiny Qwen3.5 hybrid and a chat dataset of `--samples` conversations (`--words` words a turn: ~840
tokens each at 150), then runs `hsextract extract` over it `--runs` times, each into a fresh output, and prints
per run: the first file's time after the process started, the model's load, and the summary's extraction time.
The first window of records (1024 by default) is what the worker tokenizes before its first batch: since issue
20 on a thread while the model loads (`EarlyTokens`); run it on an older commit for the figure before.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from hsextract import tiny  # noqa: E402


def one_run(model: Path, data: Path, out: Path, device: str) -> dict:
    cmd = [sys.executable, "-m", "hsextract", "extract", "--model", str(model), "--data", str(data), "--out",
           str(out), "--layers", "1,3", "--shard", "0", "--num-shards", "1", "--device", device, "--progress", "log",
           "--max-length", "4096"]
    began = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    journal = next(out.glob("shard-*/journal.jsonl"))
    entries = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    first = min(e["time"] for e in entries if e.get("kind") == "file")
    return {"first_file_s": first - began, "load_s": summary.get("load_s"), "extract_s": summary.get("extract_s"),
            "seconds": summary.get("seconds")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1100)
    ap.add_argument("--words", type=int, default=150)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-start-"))
    try:
        model = tiny.build_model(work / "model")
        data = tiny.build_dataset(work / "chat.jsonl", args.samples, seed=1, words_per_turn=args.words)
        runs = []
        for i in range(args.runs):
            runs.append(one_run(model, data, work / f"out-{i}", args.device))
            print(f"run {i + 1}: first file {runs[-1]['first_file_s']:.2f} s after the start (load "
                  f"{runs[-1]['load_s']} s), extraction {runs[-1]['extract_s']} s, whole {runs[-1]['seconds']} s",
                  flush=True)
        print(f"median first file {statistics.median(r['first_file_s'] for r in runs):.2f} s after the start over "
              f"{args.runs} runs ({args.samples} chat samples, {args.words} words a turn, device {args.device})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
