"""GPU: the worker's CUDA path (bf16) against a per-sample bf16 and fp32 reference of the same model.

    PYTHONPATH=src python3 benchmarks/gpu_correctness.py [--samples 64] [--hidden 256]

Builds a tiny Qwen3.5 hybrid on the spot, runs `hsextract extract --device cuda` (bf16 by default), reads
the files back and prints the relative error of every captured layer per sample: worker vs the same sample
alone in bf16 (`output_hidden_states=True`), and vs an fp32 reference. Exits non-zero on NaN or when an
error is outside the bf16 range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hsextract
from hsextract import tiny
from hsextract.kernels import use_fla_conv


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", default="1,3,6")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-gpu-"))
    model_dir = tiny.build_model(work / "model", hidden_size=args.hidden)
    data = tiny.build_dataset(work / "data.jsonl", args.samples, seed=2, words_per_turn=30)
    out = work / "out"
    cmd = [sys.executable, "-m", "hsextract", "extract", "--model", str(model_dir), "--data", str(data),
           "--out", str(out), "--layers", args.layers, "--shard", "0", "--num-shards", "1",
           "--device", "cuda", "--token-budget", "4096", "--progress", "log"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout[-1500:], proc.stderr[-3000:])
    if proc.returncode != 0:
        return 1
    layer_ids = [int(i) for i in args.layers.split(",")]
    refs = {dt: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).cuda().eval()
            for dt in (torch.bfloat16, torch.float32)}
    # the bf16 reference runs the kernels the worker runs (fla's causal conv where it switched to it: the log
    # says so), so "equal" means batching changed nothing; fp32 measures how far bf16 is from exact
    print("kernels switched for the references:", use_fla_conv(refs[torch.bfloat16], torch.device("cuda")) or "none")
    errors = {torch.bfloat16: [], torch.float32: []}
    nan = 0
    hidden = args.hidden
    for sample in hsextract.read_samples(out):
        got = sample["hidden_states"]
        assert got.dtype == torch.bfloat16, got.dtype
        nan += int(not torch.isfinite(got).all())
        ids = sample["input_ids"].long()[None].cuda()
        for dt, model in refs.items():
            with torch.inference_mode():
                states = model(input_ids=ids, output_hidden_states=True).hidden_states
            for slot, k in enumerate(layer_ids):
                errors[dt].append(rel(got[:, slot * hidden:(slot + 1) * hidden], states[k + 1][0].cpu()))
    summary = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("SUMMARY ")).split(" ", 1)[1])
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; {summary['samples_done']} samples, "
          f"{summary['files']} files, {summary['tokens_per_s']:.0f} tok/s (tiny model, not a throughput figure)")
    print(f"{'reference':<22}{'median rel err':>16}{'max rel err':>14}")
    for dt, errs in errors.items():
        print(f"{'alone, ' + str(dt).removeprefix('torch.'):<22}{statistics.median(errs):>16.2e}{max(errs):>14.2e}")
    print(f"samples with NaN/Inf: {nan}")
    ok = nan == 0 and max(errors[torch.bfloat16]) < 2e-2 and max(errors[torch.float32]) < 2e-2
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
