"""Model load: a real checkpoint on disk, read raw, against the worker's start to its first batch file.

    PYTHONPATH=src python3 benchmarks/model_load.py [--model-layers 24] [--samples 40]

Saves a Qwen3.6-27B-shaped checkpoint (`gpu_throughput.build_model`'s config, random bf16 weights made on the GPU)
of `--model-layers` layers as safetensors (5 GB shards), then, each with the page cache dropped first (root:
/proc/sys/vm/drop_caches; where that is refused the figures say "cache warm"):
  - raw read: every safetensors file read whole, 64 MiB at a time, nothing else (the disk's ceiling);
  - from_pretrained into host memory, then `.to("cuda")`: the worker's load before issue 20;
  - LayerCapture: the worker's own load, synchronized: straight to the GPU (`device_map`) where `accelerate`
    is importable, else the same as the row above;
  - the worker process (`hsextract extract` over `--samples` samples): start to its first batch file
    journaled, and its whole extraction; three times: on a host whose kernels were never tuned (an empty
    Triton cache) with no tuning processes (`--tune-procs 0`: the worker tunes every batch size after the
    load), the same with the default tuning processes (while the load goes on), and once more on the cache
    that run left (a host's later starts).
Goal (issue 20): the worker's start to first batch <= 1.2 x the raw read.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_throughput import SEED, build_data, build_model, worker  # noqa: E402

from hsextract.capture import LayerCapture  # noqa: E402
from hsextract.layers import parse_layer_spec  # noqa: E402


def drop_caches() -> bool:
    """Empty the page cache (root only); False where it is refused."""
    import os

    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def save_checkpoint(model_dir: Path) -> int:
    """Random bf16 weights for the config in `model_dir`, saved beside it; their bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    model.save_pretrained(model_dir, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def raw_read(model_dir: Path) -> float:
    began = time.perf_counter()
    buffer = bytearray(64 << 20)
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    return time.perf_counter() - began


def timed_load(make) -> float:
    began = time.perf_counter()
    loaded = make()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    del loaded
    torch.cuda.empty_cache()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-layers", type=int, default=24)
    ap.add_argument("--layers", default="dflash:5")
    ap.add_argument("--samples", type=int, default=40)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-load-"))
    model_dir = build_model(work / "model", args.model_layers)
    size = save_checkpoint(model_dir)
    build_data(work / "data.jsonl", args.samples)
    layer_ids = parse_layer_spec(args.layers, args.model_layers)
    print(f"checkpoint: {args.model_layers} layers, {size / 1e9:.2f} GB in "
          f"{len(list(model_dir.glob('*.safetensors')))} files", flush=True)
    rows = []
    cold = drop_caches()
    raw_s = raw_read(model_dir)
    rows.append(("raw read of the safetensors files", raw_s))
    from transformers import AutoModelForCausalLM

    drop_caches()
    rows.append(("from_pretrained into host memory, then .to(cuda) (the old load)", timed_load(
        lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).to("cuda"))))
    drop_caches()
    paths = []

    def worker_load() -> LayerCapture:
        capture = LayerCapture(model_dir, layer_ids, False, "cuda", torch.bfloat16)
        paths.append(capture.load_path)
        return capture

    seconds = timed_load(worker_load)
    rows.append((f"LayerCapture: the worker's load ({paths[0]})", seconds))
    runs = {}
    for name, extra, cache in (("untuned host, --tune-procs 0", ("--tune-procs", "0"), "cold-a"),
                               ("untuned host, tuning processes", (), "cold-b"),
                               ("tuned host (the cache the run above left)", (), "cold-b")):
        drop_caches()
        shutil.rmtree(work / "out", ignore_errors=True)
        summary = runs[name] = worker(model_dir, work / "data.jsonl", work / "out", args.layers, 8192, *extra,
                                      random_weights=False, env={"TRITON_CACHE_DIR": str(work / cache)})
        print(f"worker, {name}: load {summary['load_s']} s, tuning {summary.get('tune')}, warm-up "
              f"{summary.get('warm_s')} s, first file {summary['first_file_s']} s after its start", flush=True)
        rows.append((f"worker, {name}: its model load (load_s)", summary["load_s"]))
        rows.append((f"worker, {name}: start to first batch file", summary["first_file_s"]))
    print(f"\n{'what (' + ('cache dropped before each' if cold else 'cache warm: drop_caches refused') + ')':<60} "
          f"{'s':>8} {'GB/s':>8} {'x raw':>7}")
    for name, seconds in rows:
        print(f"{name:<60} {seconds:>8.1f} {size / 1e9 / seconds:>8.2f} {seconds / raw_s:>7.2f}")
    for name, summary in runs.items():
        print(f"worker, {name}: start to first batch / raw read = {summary['first_file_s'] / raw_s:.2f} "
              f"(goal <= 1.2); its extraction {summary['tokens_per_s']:,.0f} tok/s over {summary['extract_s']} s")
    print(f"GPU {torch.cuda.get_device_name()}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
