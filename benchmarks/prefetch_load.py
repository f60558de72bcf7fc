"""The worker's start to its model loaded, cold page cache, against a raw read of the checkpoint (CPU or GPU).

    PYTHONPATH=src python3 benchmarks/prefetch_load.py [--model-layers 4] [--device cpu] [--base REV]

Saves a Qwen3.6-27B-shaped checkpoint (`gpu_throughput.build_model`'s config, random bf16 weights) of
`--model-layers` layers in 1 GB shards with an index, then, each with the page cache dropped first (root):
a raw read of every file; the worker (`hsextract extract --dtype bfloat16`, one short sample) from process
start to its "model loaded" log line, which reads the weights ahead from its start (`WeightPrefetch`);
and with `--base REV`, the same worker at commit REV (a git worktree), e.g. the commit before the read-ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_throughput import SEED, build_model  # noqa: E402
from model_load import raw_read  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def start_to_loaded(src: Path, model_dir: Path, data: Path, out: Path, device: str, layer: int) -> tuple[float, str]:
    """Seconds from the worker's start to its 'model loaded' line, and that line."""
    cmd = [sys.executable, "-m", "hsextract", "extract", "--model", str(model_dir), "--data", str(data),
           "--out", str(out), "--layers", str(layer), "--shard", "0", "--num-shards", "1", "--device", device,
           "--dtype", "bfloat16", "--progress", "log"]
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(src)})
    for line in proc.stderr:
        if "model loaded in" in line:
            seconds = time.perf_counter() - began
            proc.kill()
            proc.wait()
            return seconds, line.strip()
    proc.wait()
    raise SystemExit(f"worker at {src} ended (rc {proc.returncode}) without loading its model")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--base", default=None, help="also time the worker of this git revision")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="hsx-prefetch-"))
    model_dir = build_model(work / "model", args.model_layers)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    model.save_pretrained(model_dir, max_shard_size="1GB")
    del model
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    data = work / "data.jsonl"
    data.write_text(json.dumps({"id": "a", "input_ids": list(range(10, 42)), "loss_mask": [1] * 32}) + "\n")
    sources = {"this tree": ROOT / "src"}
    if args.base:
        base = work / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
        sources[f"at {args.base}"] = base / "src"
    rows = []
    drop_caches()
    raw = raw_read(model_dir)
    rows.append(("raw read of the safetensors files", raw, ""))
    for name, src in sources.items():
        for attempt in range(2):
            drop_caches()
            seconds, line = start_to_loaded(src, model_dir, data, work / f"out-{len(rows)}-{attempt}", args.device,
                                            args.model_layers - 1)  # the last layer: every file is loaded
            rows.append((f"worker {name}: start to model loaded (run {attempt + 1})", seconds, line.split(": ", 1)[-1]))
    print(f"checkpoint: {args.model_layers} layers, {size / 1e9:.2f} GB in "
          f"{len(list(model_dir.glob('*.safetensors')))} files; device {args.device}; page cache dropped before each\n")
    print(f"{'what':<56} {'s':>7} {'x raw':>6}  log")
    for name, seconds, line in rows:
        print(f"{name:<56} {seconds:>7.1f} {seconds / raw:>6.2f}  {line}")
    if args.base:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "base")], check=False)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
