"""CPU: the worker end to end vs a bare forward of the same tiny model over the same batches.

    .venv/bin/python benchmarks/cpu_worker_vs_bare.py [--samples 1000] [--token-budget 8192] [--layers dflash:3]

Prints tokens/s of: a bare forward of every layer, a bare forward of only the layers the worker must run
(up to the last captured one), and the worker CLI (capture, checks, safetensors write, fsync, journal);
plus files written per 1,000 samples. Everything is built on the spot; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModel
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()

from hsextract import tiny
from hsextract.run.batching import pack
from hsextract.data.chat import ChatEncoder, Tokenized
from hsextract.run.extract import load_tokenizer
from hsextract.run.layers import parse_layer_spec
from hsextract.data.records import Record, iter_records


def bare_forward(model_dir: Path, batches: list[list[Tokenized]], num_layers: int | None) -> float:
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    if num_layers is not None:
        model.layers = model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
    tokens = sum(len(s) for b in batches for s in b)
    with torch.inference_mode():
        started = time.perf_counter()
        for batch in batches:
            ids = torch.zeros(len(batch), max(len(s) for s in batch), dtype=torch.long)
            for row, s in enumerate(batch):
                ids[row, : len(s)] = torch.tensor(s.input_ids)
            model(input_ids=ids, use_cache=False)
        return tokens / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--layers", default="dflash:3")
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-"))
    model_dir = tiny.build_model(work / "model", hidden_size=args.hidden)
    data = tiny.build_dataset(work / "data.jsonl", args.samples, seed=11, words_per_turn=40)
    info = json.loads((model_dir / "config.json").read_text())
    layer_ids = parse_layer_spec(args.layers, info["num_hidden_layers"])

    encoder = ChatEncoder(load_tokenizer(model_dir), info["vocab_size"])
    samples = [e for r in iter_records(data) if isinstance(r, Record) and isinstance(e := encoder.encode(r), Tokenized)]
    batches = list(pack(samples, args.token_budget))
    bare_all = bare_forward(model_dir, batches, None)
    bare_needed = bare_forward(model_dir, batches, max(layer_ids) + 1)

    out = work / "out"
    cmd = [sys.executable, "-m", "hsextract", "extract", "--model", str(model_dir), "--data", str(data),
           "--out", str(out), "--layers", args.layers, "--shard", "0", "--num-shards", "1",
           "--token-budget", str(args.token_budget), "--progress", "log"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    summary = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("SUMMARY ")).split(" ", 1)[1])

    tokens = sum(len(s) for s in samples)
    print(f"tiny qwen3_5_text hybrid: {info['num_hidden_layers']} layers, hidden {args.hidden}, layers {args.layers} "
          f"= {layer_ids}; {len(samples)} samples, {tokens} tokens, token budget {args.token_budget}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'what':<46}{'tokens/s':>12}")
    print(f"{'bare forward, all layers':<46}{bare_all:>12.0f}")
    print(f"{'bare forward, layers 0..' + str(max(layer_ids)) + ' (what the worker runs)':<46}{bare_needed:>12.0f}")
    print(f"{'worker, extraction phase (capture+write+fsync)':<46}{summary['tokens_per_s']:>12.0f}")
    print(f"{'worker, whole process incl. start and load':<46}{summary['tokens'] / wall:>12.0f}")
    print(f"worker / bare(same layers) = {summary['tokens_per_s'] / bare_needed:.2f}; "
          f"worker / bare(all layers) = {summary['tokens_per_s'] / bare_all:.2f}")
    print(f"files: {summary['files']} for {summary['samples_done']} samples = "
          f"{1000 * summary['files'] / summary['samples_done']:.1f} files per 1,000 samples "
          f"({summary['bytes'] / summary['files'] / 1e6:.1f} MB per file)")


if __name__ == "__main__":
    main()
