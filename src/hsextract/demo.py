"""`hsextract demo`: a tiny model and dataset built here, every shard run through the real CLI, read back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from . import tiny


def run_demo(workdir: Path, num_samples: int, num_shards: int) -> int:
    workdir = workdir.resolve()
    model, data, out = workdir / "model", workdir / "data.jsonl", workdir / "out"
    if not (model / "config.json").exists():
        print(f"building a tiny random Qwen3.5 hybrid model in {model}", flush=True)
        tiny.build_model(model, kind="qwen3_5_text")
    if not data.exists():
        tiny.build_dataset(data, num_samples)
    started = time.time()
    procs = []
    for shard in range(num_shards):
        cmd = [sys.executable, "-m", "hsextract", "extract", "--model", str(model), "--data", str(data),
               "--out", f"file://{out}", "--layers", "dflash:3", "--shard", str(shard),
               "--num-shards", str(num_shards), "--token-budget", "2048", "--progress", "log"]
        log = open(workdir / f"shard-{shard}.log", "w")
        procs.append((shard, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)))
    failed = [shard for shard, proc in procs if proc.wait() != 0]
    if failed:
        for shard in failed:
            print(f"shard {shard} failed; log {workdir}/shard-{shard}.log:\n" +
                  (workdir / f"shard-{shard}.log").read_text()[-2000:], file=sys.stderr)
        return 1
    from .reader import read_samples

    samples = tokens = 0
    for record in read_samples(out, verify=True):
        samples += 1
        tokens += len(record["input_ids"])
    files = sorted(out.glob("shard-*/batch-*.safetensors"))
    summaries = [json.loads(p.read_text()) for p in sorted(out.glob("shard-*/summary.json"))]
    skipped = sum(sum(s["skipped"].values()) for s in summaries)
    print(f"\ndone in {time.time() - started:.1f}s: {samples} samples ({skipped} skipped), {tokens} tokens, "
          f"{len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.1f} MB under {out}")
    print("read them with:\n"
          f"  python -c \"import hsextract; s = next(hsextract.read_samples('{out}')); "
          "print(s['id'], s['hidden_states'].shape)\"")
    return 0
