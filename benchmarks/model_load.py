"""Model load: a real checkpoint on disk, read raw, against the worker's start to its first batch file.

    PYTHONPATH=src python3 benchmarks/model_load.py [--model-layers 24] [--samples 40]

Saves a Qwen3.6-27B-shaped checkpoint (`gpu_throughput.build_model`'s config, random bf16 weights made on the GPU)
of `--model-layers` layers as safetensors (5 GB shards), then, each with the page cache dropped first (root:
/proc/sys/vm/drop_caches; where that is refused the figures say "cache warm"), or where it says so only the
checkpoint's pages (posix_fadvise DONTNEED: the libraries the worker imports stay cached, as on a host that ran
a worker before):
  - raw read: every safetensors file read whole, 64 MiB at a time, nothing else (the disk's ceiling);
  - with `--old-load`, from_pretrained into host memory, then `.to("cuda")`: the worker's load before issue 20;
  - LayerCapture: transformers' load from the files, synchronized: straight to the GPU (`device_map`) where
    `accelerate` is importable, else the same as the row above (with `--quick`, neither this row nor the
    eviction check);
  - the worker process (`hsextract extract` over `--samples` samples): start to its first batch queued and
    to its first batch file journaled, each phase of its start-up (the summary's `startup`, from the process's
    own start), its read-ahead, its preload and its whole extraction; first on a host whose kernels were never
    tuned (an empty Triton cache; `--save-triton-cache` keeps what it tuned, `--triton-cache` seeds a tuned
    host, and then runs everything cold first, so that the libraries are cached for the rows that say so), with
    `--tune-procs N` the same with N tuning processes during the load, then on the tuned cache with only the
    checkpoint cold: the default start (the weights read to the GPU beside the imports), `--load-after-imports`,
    the default again (seeded: `--load-after-imports` again too), then, unseeded, the default with everything
    cold (with `--old-start` also the start before issue 20's sixth session, with `--ablation` the read-ahead
    alone, with `--all-cached` both starts with the checkpoint in the page cache; `--max-runs N`: the first N).
    Each run's first batch file is kept and compared with the first run's: the same batch, so the same states,
    whichever way the weights were loaded.
Goal (issue 20): the worker's start to first batch <= 1.2 x the raw read.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


from gpu_throughput import SEED, build_data, build_model, worker
from stream_read import evict as evict_pages

from hsextract.run.capture import LayerCapture
from hsextract.run.layers import parse_layer_spec


def drop_caches(_model_dir: Path | None = None) -> bool:
    """Empty the page cache (root only); False where it is refused."""
    import os

    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def save_checkpoint(model_dir: Path, device: str) -> int:
    """Random bf16 weights for the config in `model_dir`, saved beside it; their bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    model.save_pretrained(model_dir, max_shard_size="5GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def evict_checkpoint(model_dir: Path) -> None:
    """Drop only the checkpoint's pages from the page cache (the libraries the worker imports stay cached: a
    host that ran a worker before, or had the software just installed)."""
    evict_pages(sorted(model_dir.glob("*.safetensors")))


def raw_read(model_dir: Path) -> float:
    began = time.perf_counter()
    buffer = bytearray(64 << 20)
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    return time.perf_counter() - began


def timed_load(make, device: str) -> float:
    began = time.perf_counter()
    loaded = make()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    del loaded
    gc.collect()  # a LayerCapture's hooks hold it in a cycle: its memory must go before a worker loads
    if device == "cuda":
        torch.cuda.empty_cache()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-layers", type=int, default=24)
    ap.add_argument("--layers", default="dflash:5")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--device", default="cuda", help="cuda (the measure) or cpu (a smoke run of this script)")
    ap.add_argument("--old-load", action="store_true",
                    help="also from_pretrained into host memory then .to(device) (1.20 x raw on an H100)")
    ap.add_argument("--ablation", action="store_true",
                    help="also the read-ahead alone (load and warm-up after the imports)")
    ap.add_argument("--max-runs", type=int, default=None, help="only the first N worker runs of the plan")
    ap.add_argument("--quick", action="store_true",
                    help="no eviction check, no LayerCapture row: the raw read, then the workers")
    ap.add_argument("--old-start", action="store_true",
                    help="also the start before issue 20's sixth session (no read-ahead, warm-up after the load)")
    ap.add_argument("--triton-cache", type=Path, default=None,
                    help="a tarball of a tuned Triton cache (--save-triton-cache on this kind of GPU): no untuned run")
    ap.add_argument("--save-triton-cache", type=Path, default=None,
                    help="save the cache the untuned run left as a tarball here")
    ap.add_argument("--all-cached", action="store_true",
                    help="also the default start and --load-after-imports with the checkpoint in the page cache (a "
                         "host's second worker)")
    ap.add_argument("--tune-procs", type=int, default=0,
                    help="also a run on an untuned host with this many tuning processes (0: none)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-load-"))
    model_dir = build_model(work / "model", args.model_layers)
    began = time.perf_counter()
    size = save_checkpoint(model_dir, args.device)
    print(f"checkpoint saved in {time.perf_counter() - began:.1f} s", flush=True)
    build_data(work / "data.jsonl", args.samples)
    layer_ids = parse_layer_spec(args.layers, args.model_layers)
    print(f"checkpoint: {args.model_layers} layers, {size / 1e9:.2f} GB in "
          f"{len(list(model_dir.glob('*.safetensors')))} files", flush=True)
    rows = []

    def row(name: str, seconds: float | None) -> None:  # printed as measured: a run cut short keeps its figures
        if seconds is None:
            print(f"{name}: not measured", flush=True)
            return
        rows.append((name, seconds))
        print(f"{name}: {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s, {seconds / raw_s:.2f} x raw)", flush=True)

    cold = drop_caches()
    raw_s = raw_read(model_dir)
    row("raw read of the safetensors files", raw_s)
    if not args.quick:
        evict_checkpoint(model_dir)
        row("raw read, only the checkpoint evicted (a check of the eviction)", raw_read(model_dir))
    if args.old_load:
        from transformers import AutoModelForCausalLM

        drop_caches()
        row(f"from_pretrained into host memory, then .to({args.device}) (the old load)", timed_load(
            lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True)
            .to(args.device), args.device))
    drop_caches()
    paths = []

    def worker_load() -> LayerCapture:
        capture = LayerCapture(model_dir, layer_ids, False, args.device, torch.bfloat16)
        paths.append(capture.load_path)
        return capture

    if not args.quick:
        seconds = timed_load(worker_load, args.device)
        row(f"LayerCapture: the worker's load ({paths[0]})", seconds)
        torch.cuda.synchronize() if args.device == "cuda" else None
        print(f"after it, this process holds {torch.cuda.memory_allocated() / 1e9:.2f} GB on the GPU"
              if args.device == "cuda" else "", flush=True)
    runs = {}
    cache_dir = work / "triton"
    if args.triton_cache:  # a host tuned before: the cache a run on this kind of GPU left
        cache_dir.mkdir()
        subprocess.run(["tar", "xzf", str(args.triton_cache), "-C", str(cache_dir)], check=True)
    sixth = ("--load-after-imports",)
    old = ("--read-ahead-gb", "0", "--warm-after-load", "--load-after-imports")
    seeded = bool(args.triton_cache)

    def keep(_model_dir: Path) -> None:  # nothing evicted: the checkpoint read by another worker of the host
        pass

    cached = "tuned host, libraries cached"
    plans = [*([] if seeded else [("untuned host (an empty Triton cache), default start", (), drop_caches)]),
             *([(f"untuned host, --tune-procs {args.tune_procs}", ("--tune-procs", str(args.tune_procs)),
                 drop_caches)] if args.tune_procs else []),
             # seeded, the all-cold run comes first: after it the libraries are cached, as the rows below say
             *([("tuned host, all cold: default start", (), drop_caches)] if seeded else []),
             (f"{cached}: default start", (), evict_checkpoint),
             (f"{cached}: load after the imports (the sixth session's start)", sixth, evict_checkpoint),
             *([(f"{cached}: the old start (no read-ahead, warm-up after the load)", old, evict_checkpoint)]
               if args.old_start else []),
             *([(f"{cached}: read-ahead only (load and warm-up after the imports)",
                 ("--load-after-imports", "--warm-after-load"), evict_checkpoint)] if args.ablation else []),
             (f"{cached}: default start, again", (), evict_checkpoint),
             *([(f"{cached}: load after the imports, again", sixth, evict_checkpoint)] if seeded else []),
             *([] if seeded else [("tuned host, all cold: default start", (), drop_caches)]),
             *([("tuned host, all cold: the old start", old, drop_caches)] if args.old_start else []),
             *([("tuned host, all cached (the checkpoint read by another worker): default start", (), keep),
                ("tuned host, all cached: load after the imports", sixth, keep)] if args.all_cached else [])]
    firsts = {}  # each run's first batch file: the same batch, so the same states, whichever way it loaded
    for name, extra, evict in plans[:args.max_runs]:
        evict(model_dir)
        shutil.rmtree(work / "out", ignore_errors=True)
        summary = runs[name] = worker(model_dir, work / "data.jsonl", work / "out", args.layers, 8192, *extra,
                                      random_weights=False, env={"TRITON_CACHE_DIR": str(cache_dir)},
                                      device=args.device, keep_first=True)
        first = next(p for p in (work / "out").glob("shard-*/batch-*.safetensors"))
        firsts[name] = load_file(str(first))
        nan = sum(int((~torch.isfinite(t.float())).any()) for k, t in firsts[name].items() if t.is_floating_point())
        same = {k: torch.equal(t, firsts[next(iter(firsts))][k]) for k, t in firsts[name].items()}
        print(f"worker, {name}: its first file: {sum(t.numel() for t in firsts[name].values()):,} values, "
              f"{nan} tensor(s) with NaN/Inf; equal to the first run's first file: {all(same.values())} "
              f"({[k for k, v in same.items() if not v]} differ)", flush=True)
        startup = summary.get("startup", {})
        print(f"worker, {name}: load {summary['load_s']} s, tuning {summary.get('tune')}, warm-up "
              f"{summary.get('warm_s')} s, read-ahead {summary.get('read_ahead')}, preload {summary.get('preload')}; "
              f"from its start: " + ", ".join(f"{k} {v:.1f}" for k, v in startup.items()), flush=True)
        for line in summary.get("log", []):
            print(f"    {line}", flush=True)
        row(f"worker, {name}: its model load (load_s)", summary["load_s"])
        row(f"worker, {name}: start to first batch (queued)", startup.get("first_forward"))
        row(f"worker, {name}: start to first batch file", startup.get("first_file", summary["first_file_s"]))
        if args.save_triton_cache and name.startswith("untuned"):
            subprocess.run(["tar", "czf", str(args.save_triton_cache), "-C", str(cache_dir), "."], check=True)
            size_mb = args.save_triton_cache.stat().st_size / 1e6
            print(f"Triton cache saved: {args.save_triton_cache} ({size_mb:.1f} MB)", flush=True)
    print(f"\n{'what (' + ('cache dropped before each' if cold else 'cache warm: drop_caches refused') + ')':<60} "
          f"{'s':>8} {'GB/s':>8} {'x raw':>7}")
    for name, seconds in rows:
        print(f"{name:<60} {seconds:>8.1f} {size / 1e9 / seconds:>8.2f} {seconds / raw_s:>7.2f}")
    for name, summary in runs.items():
        first = summary.get("startup", {}).get("first_forward")
        if first is not None:
            print(f"worker, {name}: start to first batch / raw read = {first / raw_s:.2f} (goal <= 1.2); its "
                  f"extraction {summary['tokens_per_s']:,.0f} tok/s over {summary['extract_s']} s")
    print(f"GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else f"device {args.device}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
