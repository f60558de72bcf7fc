"""GPU: the worker's CUDA path (bf16) against a per-sample bf16 and fp32 reference of the same model.

    PYTHONPATH=src python3 benchmarks/gpu_correctness.py [--samples 64] [--hidden 256] [--kernels fused]
    PYTHONPATH=src python3 benchmarks/gpu_correctness.py --shape27b 16    # the kernels' error at the real shape

Builds a tiny Qwen3.5 hybrid on the spot (saved in bf16), runs `hsextract extract --device cuda` (bf16 by
default), reads the files back and prints the relative error of every captured layer per sample: worker vs the
same sample alone in bf16 (`output_hidden_states=True`), and vs an fp32 reference; and runs the worker again
with `--load-after-imports`, whose states must equal the first run's (weights preloaded to the GPU beside the
imports vs read by transformers). Exits non-zero on NaN, when an error is outside the bf16 range, when the
preload was not used or when the two runs differ. With `--kernels fused` the worker and the bf16 reference run
the fused kernels (the fp32 reference stays transformers' own): "equal" then says batching changed nothing.

`--shape27b N`: N layers of the Qwen3.6-27B shape with random weights (made on the GPU in fp32 from one seed),
`--samples` samples of 200-3000 tokens each run alone: the last layer's relative error of the bf16 model with
the default kernels and with the fused ones against the fp32 model (transformers' own path), side by side.
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
from hsextract.run.kernels import apply_kernels, restore_forwards


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", default="1,3,6")
    ap.add_argument("--kernels", default="default", choices=("default", "fused"))
    ap.add_argument("--no-preload-check", action="store_true", help="skip the second worker run (--load-after-imports)")
    ap.add_argument("--shape27b", type=int, default=0, metavar="LAYERS")
    args = ap.parse_args()
    if args.shape27b:
        return shape27b(args.shape27b, args.samples)
    work = Path(tempfile.mkdtemp(prefix="hsx-gpu-"))
    model_dir = tiny.build_model(work / "model", hidden_size=args.hidden)
    # saved in bf16, the worker's dtype, as real checkpoints are: its weights are read to the GPU beside its imports
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(model_dir)
    data = tiny.build_dataset(work / "data.jsonl", args.samples, seed=2, words_per_turn=30)
    out = work / "out"

    def worker(dest: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
        cmd = [sys.executable, "-m", "hsextract", "extract", "--model", str(model_dir), "--data", str(data),
               "--out", str(dest), "--layers", args.layers, "--shard", "0", "--num-shards", "1",
               "--device", "cuda", "--token-budget", "4096", "--progress", "log", "--kernels", args.kernels, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-1500:], proc.stderr[-3000:])
        lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
        return proc, json.loads(lines[-1].split(" ", 1)[1]) if lines else {}

    proc, summary = worker(out)
    if proc.returncode != 0:
        return 1
    print("the worker's preload:", summary.get("preload"))
    unequal = []
    if not args.no_preload_check:
        # the same worker with the weights read by transformers after the imports: the same states, to the bit
        again, _ = worker(work / "out-files", "--load-after-imports")
        if again.returncode != 0:
            return 1
        firsts = {s["id"]: s["hidden_states"] for s in hsextract.read_samples(out)}
        unequal = [s["id"] for s in hsextract.read_samples(work / "out-files")
                   if not torch.equal(firsts[s["id"]], s["hidden_states"])]
        print(f"states with the weights preloaded vs read by transformers after the imports: "
              f"{len(unequal)} of {len(firsts)} samples differ {unequal[:5]}")
    layer_ids = [int(i) for i in args.layers.split(",")]
    refs = {dt: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).cuda().eval()
            for dt in (torch.bfloat16, torch.float32)}
    # the bf16 reference runs the kernels the worker runs (its log says which), so "equal" means batching changed
    # nothing; fp32 (transformers' own path) measures how far bf16 is from exact
    print("kernels switched for the bf16 reference:",
          apply_kernels(refs[torch.bfloat16], torch.device("cuda"), args.kernels) or "none")
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
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; {summary['samples_done']} samples, "
          f"{summary['files']} files, {summary['tokens_per_s']:.0f} tok/s (tiny model, not a throughput figure)")
    print(f"{'reference':<22}{'median rel err':>16}{'max rel err':>14}")
    for dt, errs in errors.items():
        print(f"{'alone, ' + str(dt).removeprefix('torch.'):<22}{statistics.median(errs):>16.2e}{max(errs):>14.2e}")
    print(f"samples with NaN/Inf: {nan}")
    equal = sum(e == 0.0 for e in errors[torch.bfloat16])
    print(f"worker ({args.kernels} kernels) equal to the bf16 reference alone: {equal} of {len(errors[torch.bfloat16])}")
    ok = nan == 0 and max(errors[torch.bfloat16]) < 2e-2 and max(errors[torch.float32]) < 2e-2 and not unequal \
        and (summary.get("preload") or {}).get("used") and equal == len(errors[torch.bfloat16])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def shape27b(layers: int, samples: int) -> int:
    """See the module's docstring: the default and fused kernels' error against fp32 at the real shape."""
    import copy
    import random

    from transformers import AutoConfig, AutoModelForCausalLM

    from gpu_throughput import build_model  # the sibling benchmark's model shape (benchmarks/ is the script's folder)

    work = Path(tempfile.mkdtemp(prefix="hsx-27b-"))
    config = AutoConfig.from_pretrained(build_model(work / "model", layers))
    torch.manual_seed(0)
    with torch.device("cuda"):
        exact = AutoModelForCausalLM.from_config(config, dtype=torch.float32).model.eval()
    half = copy.deepcopy(exact).to(torch.bfloat16)
    rng = random.Random(0)
    batch = [torch.randint(10, 32000, (1, rng.randint(200, 3000)), device="cuda") for _ in range(samples)]
    device = torch.device("cuda")
    errors = {}
    with torch.inference_mode():
        want = [exact(input_ids=ids, use_cache=False).last_hidden_state.double() for ids in batch]
        for choice in ("default", "fused"):
            restore_forwards(half)
            print(f"{choice}: switched {apply_kernels(half, device, choice)}", flush=True)
            half(input_ids=batch[0], use_cache=False)  # compile and tune first
            got = [half(input_ids=ids, use_cache=False).last_hidden_state.double() for ids in batch]
            errors[choice] = [((g - w).norm() / w.norm()).item() for g, w in zip(got, want)]
            nan = sum(int(not torch.isfinite(g).all()) for g in got)
            print(f"{layers} layers of the 27B shape, {samples} samples alone, last layer vs fp32: {choice} kernels "
                  f"median {statistics.median(errors[choice]):.3e}, max {max(errors[choice]):.3e}, NaN {nan}",
                  flush=True)
    ratio = statistics.median(errors["fused"]) / statistics.median(errors["default"])
    print(f"fused / default median error against fp32: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
