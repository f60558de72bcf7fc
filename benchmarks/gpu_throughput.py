"""Extraction throughput on a GPU against its two ceilings, side by side, in one run.

    PYTHONPATH=src python3 benchmarks/gpu_throughput.py [--model-layers 32] [--samples 2000] [--fp8] [--out DIR]
    PYTHONPATH=src python3 benchmarks/gpu_throughput.py --model-layers 64 --bare-only   # full depth: MFU only

Writes a Qwen3.6-27B-shaped hybrid config (hidden 5120, intermediate 17408, 24 heads / 4 KV heads of 256,
Gated DeltaNet 16 key / 48 value heads of 128, full attention every 4th layer) with `--model-layers` layers and
a tokenizer, and no weights: every model here is made on the GPU from the config and one seed
(`hsextract extract --random-weights`), so the full 64-layer depth needs no 54 GB checkpoint on disk. The
default (32 layers, 2000 samples, ~2.5M tokens) is the regime users run in: the GPU is the ceiling, and the
worker's extraction lasts over 2 minutes, so its start-up is seen for what it is. A pre-tokenized dataset
with lognormal lengths (median ~1K, max 4096). Then, on the same model and data, prints:
  - bare forward tok/s: the stack over the first `--ceiling-batches` packed batches, nothing captured (the
    GPU ceiling), and its model FLOPs utilisation: 2 x non-embedding parameters x tokens/s over the dense
    bf16 peak (`--peak-tflops`, 989 for an H100/H200 SXM); beside it, the same with the model making its own
    attention masks (a host sync per forward; the worker makes them once: `LayerCapture.settle_masks`);
  - the host syncs in one batch (torch's sync debug mode): the bare forward each way, and the worker's whole
    device-side step (capture, NaN flags, fp8 quantization), which should have none;
  - capture tok/s: the worker's hooks filling the output buffer, nothing copied out;
  - sink bytes/s: those batches' file sizes of random bytes written with no GPU work: raw write + fsync one
    file at a time, raw with file n's fsync overlapping file n+1's write, raw from 4 threads at once (the
    sink ceiling is the best of the three), zero bytes (storage that compresses or dedups writes these
    faster: a hint, not a ceiling), and the worker's own `write_batch` one file at a time; as tok/s
    equivalents;
  - the worker end to end (`hsextract extract` over the whole dataset, tok/s over its extraction loop), its
    steady state, padding waste and peak GPU memory; files are deleted once journaled (the disk holds a
    few), so a run may write far more than the disk;
  - with `--fp8`: the fp8 sizes' raw sink and the worker with `--out-dtype fp8_e4m3`;
  - the naive per-sample loop (batch 1, output_hidden_states=True, logits, torch.save per sample);
  - ratios: worker / min(GPU ceiling, sink ceiling) (goal >= 0.95 whole loop, >= 0.98 steady) and
    worker / naive.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from hsextract import tiny
from hsextract.output.batchfile import write_batch
from hsextract.run.batching import pack, padded_tokens
from hsextract.run.capture import LayerCapture
from hsextract.run.layers import parse_layer_spec
from hsextract.output.quant import fp8_bytes_per_token

VOCAB = 32000


SEED = 0  # every model here: the same random weights (the worker's --random-weights and LayerCapture's)


def build_model(out: Path, layers: int) -> Path:
    """A model directory holding the config and a tokenizer, no weights (made from SEED where they run)."""
    from transformers import Qwen3_5TextConfig

    tiny.build_tokenizer(out)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=5120, intermediate_size=17408, num_hidden_layers=layers,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4,
        max_position_embeddings=8192, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)
    config.save_pretrained(out)
    return out


def build_data(path: Path, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lengths = [min(4096, max(16, int(rng.lognormvariate(math.log(1000), 0.7)))) for _ in range(n)]
    with path.open("w") as handle:
        for i, length in enumerate(lengths):
            ids = [rng.randrange(10, VOCAB) for _ in range(length)]
            mask = [0] * (length // 3) + [1] * (length - length // 3)
            handle.write(json.dumps({"id": f"s{i:06d}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return lengths


class Sized:
    def __init__(self, ids):
        self.input_ids = ids

    def __len__(self):
        return len(self.input_ids)


def batches(data: Path, budget: int) -> list[list[list[int]]]:
    samples = [Sized(json.loads(line)["input_ids"]) for line in data.open()]
    return [[s.input_ids for s in b] for b in pack(samples, budget, 1024)]


PLANNER_SAMPLES = 20000


def planner_waste(budget: int, window: int = 1024) -> float:
    """Padded / real tokens - 1 of the worker's packing over a realistic number of samples (CPU only)."""
    rng = random.Random(1)
    samples = [Sized([0] * min(4096, max(16, int(rng.lognormvariate(math.log(1000), 0.7)))))
               for _ in range(PLANNER_SAMPLES)]
    packed = list(pack(samples, budget, window))
    return sum(padded_tokens(b) for b in packed) / sum(len(s) for b in packed for s in b) - 1


def timed(fn, reps: int = 1) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


PHASES: list[tuple[str, float, float]] = []


@contextlib.contextmanager
def phase(name: str):
    """Marks a stretch of the run in wall-clock time (to line up with a GPU clock/power log)."""
    began = time.time()
    try:
        yield
    finally:
        PHASES.append((name, began, time.time()))
        print(f"phase {name!r}: {began:.1f} .. {time.time():.1f}", flush=True)


def spread(every: list, n: int) -> list:
    """`n` of `every`, evenly spaced from its first to its last (all of it when n is 0 or too large)."""
    if n <= 0 or n >= len(every):
        return list(every)
    if n == 1:
        return [every[0]]
    return [every[i * (len(every) - 1) // (n - 1)] for i in range(n)]


class HostLoad:
    """The worker's host-side work without the worker, beside a forward loop: one thread copying device memory
    into a pinned buffer on a side stream, `hashers` threads hashing and one thread writing + fsyncing random
    bytes, each at `rate` bytes/s (the worker's output rate at the GPU's pace). Does the forward slow down when
    the host is this busy? (The worker's device is idler inside its forwards than the bare forward's.)"""

    def __init__(self, where: Path, rate: float, hashers: int = 3, part: int = 256 << 20):
        import threading

        self.where, self.rate, self.hashers, self.part = where, rate, hashers, part
        self.stop = threading.Event()
        self.noise = os.urandom(part)
        self.moved = {"copied": 0, "hashed": 0, "written": 0}
        jobs = [self._copy, self._write] + [self._hash] * hashers
        self.threads = [threading.Thread(target=job, daemon=True) for job in jobs]

    def _paced(self, began: float, share: float) -> None:
        """Sleep so that `part` bytes per call make `share` of the rate."""
        self.stop.wait(max(0.0, self.part / (self.rate * share) - (time.perf_counter() - began)))

    def _copy(self) -> None:
        src = torch.empty(self.part, dtype=torch.uint8, device="cuda")
        dst = torch.empty(self.part, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream()
        while not self.stop.is_set():
            began = time.perf_counter()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            self.moved["copied"] += self.part
            self._paced(began, 1.0)

    def _hash(self) -> None:
        import hashlib

        while not self.stop.is_set():
            began = time.perf_counter()
            hashlib.sha256(self.noise).digest()
            self.moved["hashed"] += self.part
            self._paced(began, 1.0 / self.hashers)

    def _write(self) -> None:
        n = 0
        while not self.stop.is_set():
            began = time.perf_counter()
            path = self.where / f"load-{n % 2}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
            try:
                view = memoryview(self.noise)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            self.moved["written"] += self.part
            n += 1
            self._paced(began, 1.0)

    def __enter__(self) -> "HostLoad":
        self.where.mkdir(parents=True, exist_ok=True)
        self.began = time.perf_counter()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        seconds = time.perf_counter() - self.began
        self.rates = {k: v / seconds for k, v in self.moved.items()}
        shutil.rmtree(self.where, ignore_errors=True)


def host_syncs(capture: LayerCapture, batch: list[list[int]], hooks: dict) -> dict[str, dict[str, int]]:
    """Where one batch makes the host wait for the GPU (torch's sync debug mode): the bare forward with the worker's
    masks made once, with the model's own, and the worker's whole device-side step (`LayerCapture.run` with its
    hooks, the state checks, fp8's quantization). Returns {way: {"file:line": count}}, printed."""
    import warnings

    from hsextract.run.extract import ShardRun
    from hsextract.output.quant import quantize

    ids = torch.zeros(len(batch), max(len(s) for s in batch), dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s)] = torch.tensor(s)
    ids = ids.cuda()

    def worker_step():
        for i, h in hooks.items():
            capture.backbone.layers[i]._forward_hooks.update(h)
        try:
            states = capture.run(batch)
            ShardRun.check_states(batch, states, len(hooks))
            quantize(states["hidden_states"], capture.hidden_size)
        finally:
            for i in hooks:
                capture.backbone.layers[i]._forward_hooks.clear()

    with warnings.catch_warnings(record=True):  # a first switch of the debug mode, so that none is counted below
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")
    found, made_once = {}, capture.masks
    ways = {"bare forward, masks made once": (made_once, lambda: capture.forward(ids)),
            "bare forward, the model's own masks": (None, lambda: capture.forward(ids)),
            "the worker's step (run, state checks, fp8)": (made_once, worker_step)}
    for way, (masks, step) in ways.items():
        if way.endswith("made once") and masks is None:
            continue
        capture.masks = masks
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                capture.masks = made_once
        sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                    if "synchroniz" in str(w.message))
        found[way] = dict(sites)
        print(f"host syncs in one batch, {way}: {sum(sites.values())} "
              f"{dict(sites.most_common(8)) if sites else ''}", flush=True)
    return found


def bare_and_capture(model_dir: Path, layer_ids: list[int], packed, bare_only: bool = False,
                     compiled: str | None = None, reference: bool = True, sustained=None, budget: int = 8192,
                     host_load: tuple[Path, int] | None = None, kernels: str = "default") -> dict:
    """The bare forward (the GPU ceiling, with the kernels the worker uses) and the capture, on the same model and
    batches; side by side, the bare forward with transformers' reference causal convolution and, with
    `compiled`, with every decoder layer ("layers") or every layer's MLP ("mlp") under torch.compile (dynamic
    shapes), each with the relative error
    of the first batch's last layer against the worker's kernels; and fla's convolution against the reference
    in fp32 on one layer's weights. With `sustained` (batches), the bare forward is timed over those instead (e.g.
    all the run's batches: the same work as the worker, for as long). With `host_load` (a scratch directory, bytes
    per token), the bare forward over `packed` is timed quiet, then beside a `HostLoad` at the worker's output
    rate, then quiet again. The kernels are warmed for every batch size as the worker warms them. Returns tok/s
    figures and more."""
    from hsextract.run.kernels import fla_causal_conv1d, reference_conv, restore_reference_conv, use_fla_conv

    from hsextract.run.batching import batch_size_buckets
    from hsextract.run.prewarm import SHORTEST, Prewarm, default_procs

    tokens = sum(len(s) for b in packed for s in b)
    bare_tokens = sum(len(s) for b in sustained or packed for s in b)
    # the worker's start: kernels tuned for every batch size by child processes while the model is made
    tuning = Prewarm.start(model_dir, batch_size_buckets(budget // SHORTEST), budget, "cuda", torch.bfloat16,
                           default_procs(), kernels)
    began = time.perf_counter()
    capture = LayerCapture(model_dir, layer_ids, False, "cuda", torch.bfloat16, random_weights=SEED, kernels=kernels)
    torch.cuda.synchronize()
    out = {"made_s": time.perf_counter() - began, "kernels": capture.kernels}
    out["tune_s"] = tuning.wait(900)
    if tuning.failures:
        print(f"tuning processes failed: {tuning.failures}", flush=True)
    out["params"] = sum(p.numel() for name, p in capture.backbone.named_parameters() if "embed_tokens" not in name)

    def one(batch):
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, : len(s)] = torch.tensor(s)
        return ids.cuda(non_blocking=True)

    inputs = [one(b) for b in packed]
    bare_inputs = [one(b) for b in sustained] if sustained else inputs
    hooks = {i: dict(capture.backbone.layers[i]._forward_hooks) for i in layer_ids}

    @torch.inference_mode()
    def run_bare(over=inputs):
        for ids in over:
            capture.forward(ids)

    @torch.inference_mode()
    def first_state():
        return capture.forward(inputs[0]).last_hidden_state

    @torch.inference_mode()
    def run_capture():
        for batch in packed:
            capture.run(batch)

    began = time.perf_counter()
    capture.warm_up(budget)
    torch.cuda.synchronize()
    out["warm_s"] = time.perf_counter() - began
    print(f"kernels tuned by {len(tuning.procs)} processes in {out['tune_s']:.1f}s from their start (model made in "
          f"{out['made_s']:.1f}s meanwhile), then warmed in {out['warm_s']:.1f}s", flush=True)
    if not bare_only:
        run_capture()  # warm-up: kernels compiled, allocator filled
    for i in layer_ids:
        capture.backbone.layers[i]._forward_hooks.clear()
    run_bare()
    with phase("bare forward" + (f" over {len(bare_inputs)} batches" if sustained else "")):
        if sustained:  # each batch's device time too (events on the stream: nothing waits), for any stretch's rate
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(bare_inputs) + 1)]
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.inference_mode():
                marks[0].record()
                for ids, mark in zip(bare_inputs, marks[1:]):
                    capture.forward(ids)
                    mark.record()
            torch.cuda.synchronize()
            out["bare"] = bare_tokens / (time.perf_counter() - started)
            out["batch_s"] = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            out["bare"] = bare_tokens / timed(lambda: run_bare(bare_inputs))
    bare_inputs = None  # noqa: F841 - freed before the variants
    if host_load:
        where, per_token = host_load
        loaded = {}
        for name in ("quiet", "host load", "quiet again"):
            with phase(f"bare forward, {name}"):
                if name == "host load":
                    with HostLoad(where, out["bare"] * per_token) as load:
                        loaded[name] = tokens / timed(run_bare)
                    loaded["load_rates"] = load.rates
                else:
                    loaded[name] = tokens / timed(run_bare)
        out["host_load"] = loaded
        print(f"bare forward over {len(packed)} batches: quiet {loaded['quiet']:,.0f} tok/s, beside the worker's host "
              f"work {loaded['host load']:,.0f} ({loaded['host load'] / loaded['quiet']:.3f}x; copied / hashed / "
              f"written " + " / ".join(f"{v / 2**30:.2f}" for v in loaded["load_rates"].values()) + " GiB/s), quiet "
              f"again {loaded['quiet again']:,.0f}", flush=True)
    want = first_state()
    out["syncs"] = host_syncs(capture, packed[0], hooks)
    variants = {}
    if capture.masks is not None:  # the worker's masks made once, against the model's own (a host sync a forward)
        masks, capture.masks = capture.masks, None
        with phase("bare forward, the model's own masks"):
            variants["the model's own attention masks (a host sync per forward)"] = (
                tokens / timed(run_bare), rel_err(first_state(), want), 0.0)
        capture.masks = masks
    if capture.kernels and reference:  # the worker switched the conv to fla's kernel: the reference beside it
        linear = next(m for m in capture.backbone.modules() if hasattr(m, "conv1d"))
        reference = reference_conv(linear)
        x_BDT = torch.randn(2, linear.conv1d.weight.shape[0], 3000, device="cuda", dtype=torch.bfloat16)
        weight = linear.conv1d.weight.squeeze(1)
        with torch.inference_mode():
            want_conv = reference(x_BDT.float(), weight.float(), None, activation="silu")
            out["conv_rel_err"] = {"fla (bf16)": rel_err(fla_causal_conv1d(x_BDT, weight, None, "silu"), want_conv),
                                   "reference (bf16)": rel_err(reference(x_BDT, weight, None, activation="silu"),
                                                               want_conv)}
        print(f"causal conv1d, one layer's weights, random bf16 input [2, {x_BDT.shape[1]}, 3000], rel err against "
              f"the reference in fp32: {out['conv_rel_err']}", flush=True)
        restore_reference_conv(capture.backbone)
        run_bare()
        variants["reference causal_conv1d (transformers' PyTorch path)"] = (
            tokens / timed(run_bare), rel_err(first_state(), want), 0.0)
        use_fla_conv(capture.backbone, capture.device)
    if compiled:
        targets = [layer.mlp if compiled == "mlp" else layer for layer in capture.backbone.layers]
        try:
            import torch._dynamo as dynamo

            dynamo.config.cache_size_limit = max(64, dynamo.config.cache_size_limit)
            for module in targets:
                module.compile(dynamic=True)
            started = time.perf_counter()
            run_bare()  # compiles: every module kind, then the shapes as dynamic
            torch.cuda.synchronize()
            warm = time.perf_counter() - started
            print(f"torch.compile ({compiled}): compiled and ran {len(packed)} batches in {warm:.0f}s", flush=True)
            variants[f"torch.compile per decoder {'MLP' if compiled == 'mlp' else 'layer'} (dynamic)"] = (
                tokens / timed(run_bare), rel_err(first_state(), want), warm)
        except Exception as exc:  # noqa: BLE001 - a measurement: say why it could not be made
            print(f"torch.compile failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        for module in targets:
            module._compiled_call_impl = None
    out["variants"] = variants
    if bare_only:
        return out
    for i, h in hooks.items():
        capture.backbone.layers[i]._forward_hooks.update(h)
    with phase("capture"):
        out["capture"] = tokens / timed(run_capture)
    out["state_checks"] = state_checks(capture, packed, layer_ids, run_capture)
    return out  # model and inputs are freed on return


def nonfinite_only(batch, states: dict, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The worker's checks of the states as they were before issue 38: the NaN/Inf flags alone (one isfinite pass
    per tensor), no layer statistics (zeros in their place: no layer is degenerate)."""
    device = states["hidden_states"].device
    lengths = torch.tensor([len(s) for s in batch], pin_memory=device.type == "cuda").to(device, non_blocking=True)
    sample_of_T = torch.repeat_interleave(torch.arange(len(batch), device=device), lengths,
                                          output_size=sum(len(s) for s in batch))
    bad_B = torch.zeros(len(batch), device=device)
    for tensor in states.values():
        bad_B.index_add_(0, sample_of_T, (~torch.isfinite(tensor)).any(dim=1).float())
    return bad_B > 0, torch.zeros(layers, 3, device=device)


def state_checks(capture: LayerCapture, packed, layer_ids: list[int], run_capture) -> dict:
    """What the worker's checks of the states cost on the GPU (issue 38): the capture over the same batches with the
    worker's per-batch checks after each forward (`ShardRun.check_states`), with the checks of before (NaN/Inf
    flags alone: `nonfinite_only`) and without any, alternated three times; and each one's device time over the
    batches (CUDA events)."""
    from hsextract.run.extract import ShardRun

    ways = {"none": None, "before (NaN/Inf flags)": nonfinite_only, "now (check_states)": ShardRun.check_states}

    @torch.inference_mode()
    def checked(check, timing: bool = False) -> float:
        spent = 0.0
        for batch in packed:
            states = capture.run(batch)
            if check is None:
                continue
            if timing:
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record()
            check(batch, states, len(layer_ids))
            if timing:
                after.record()
                after.synchronize()
                spent += before.elapsed_time(after) / 1e3
        return spent

    tokens = sum(len(s) for b in packed for s in b)
    rates = {name: [] for name in ways}
    with phase("capture with and without the state checks"):
        for _ in range(3):
            for name, check in ways.items():
                rates[name].append(tokens / timed(lambda check=check: checked(check)))
    capture_s = tokens / max(rates["none"])
    device_s = {name: checked(check, timing=True) for name, check in ways.items() if check is not None}
    figures = {"rates": rates, "device_s": device_s, "capture_s": capture_s}
    print(f"state checks over {len(packed)} batches, capture (best of 3): " + ", ".join(
        f"{name} {max(r):,.0f} tok/s ({max(r) / max(rates['none']):.4f}x)" for name, r in rates.items())
        + "; device time: " + ", ".join(f"{name} {s * 1e3:.1f} ms = {s / capture_s:.3%} of the capture's"
                                        for name, s in device_s.items()), flush=True)
    return figures


#: writer threads of the sink's `parallel` figure
LANES = 4
#: the raw sink figures the sink ceiling is the best of (`zeros` is a hint, `ours` the worker's own code)
CEILING_FIGURES = ("serial", "overlapped", "parallel")


def sink(out: Path, packed, bytes_per_token: int, ours: bool = True) -> dict[str, float]:
    """Bytes/s of writing the same file sizes with no GPU work, random (incompressible) bytes:
    `ours` = the worker's `write_batch` one file at a time (lay out + sha256 + write + fsync + rename);
    `serial` = raw write + fsync, one file at a time; `overlapped` = raw, file n+1 written while file n is
    fsynced (what the worker's write and seal threads do); `parallel` = raw, LANES threads each writing and
    fsyncing every LANES-th file (a disk that wants more requests in flight). The sink ceiling is the best of
    the three. `zeros` = serial, zero bytes: far faster than `serial` says the storage compresses or dedups
    (then the real states' bytes, not random ones, set the ceiling); not a ceiling itself."""
    import threading

    out.mkdir(parents=True, exist_ok=True)
    sizes = [sum(len(s) for s in b) * bytes_per_token for b in packed]
    total = sum(sizes)
    noise = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8)
    figures = {}

    def fresh():
        shutil.rmtree(out)
        out.mkdir()
        return time.perf_counter()

    def drop(i: int) -> None:  # the disk holds a few files at a time, however many the run writes
        for old in (out / f"r{i - 2:06d}", out / f"b{i - 2:06d}.safetensors"):
            old.unlink(missing_ok=True)

    if ours:
        start = fresh()
        for i, size in enumerate(sizes):
            write_batch(out / f"b{i:06d}.safetensors", {"hidden_states": noise[:size]}, {"sample_ids": "[]"})
            drop(i)
        figures["ours"] = total / (time.perf_counter() - start)

    def write(i: int, size: int, source=noise) -> int:
        fd = os.open(out / f"r{i:06d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        view = memoryview(source.numpy())[:size]
        while view:
            view = view[os.write(fd, view):]
        return fd

    def seal(fd: int) -> None:
        os.fsync(fd)
        os.close(fd)

    start = fresh()
    for i, size in enumerate(sizes):
        seal(write(i, size))
        drop(i)
    figures["serial"] = total / (time.perf_counter() - start)

    start = fresh()
    sealing = None
    for i, size in enumerate(sizes):
        fd = write(i, size)
        if sealing is not None:
            sealing.join()
        sealing = threading.Thread(target=seal, args=(fd,))
        sealing.start()
        drop(i)
    sealing.join()
    figures["overlapped"] = total / (time.perf_counter() - start)

    def lane(first: int) -> None:
        for i in range(first, len(sizes), LANES):
            seal(write(i, sizes[i]))
            (out / f"r{i - LANES:06d}").unlink(missing_ok=True)  # its own file before: a few on disk at a time

    start = fresh()
    lanes = [threading.Thread(target=lane, args=(j,)) for j in range(LANES)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    figures["parallel"] = total / (time.perf_counter() - start)
    zeros = torch.zeros_like(noise)
    start = fresh()
    for i, size in enumerate(sizes):
        seal(write(i, size, zeros))
        drop(i)
    figures["zeros"] = total / (time.perf_counter() - start)
    shutil.rmtree(out)
    return figures


#: the worker with its checks of the states as before issue 38 (`nonfinite_only`: the NaN/Inf flags alone), for the
#: before/after of what the checks cost (benchmarks/ on its PYTHONPATH)
NO_STATE_CHECKS = """
import runpy, sys
from gpu_throughput import nonfinite_only
from hsextract.run.extract import ShardRun
ShardRun.check_states = staticmethod(nonfinite_only)
sys.argv = ["hsextract", *sys.argv[1:]]
runpy.run_module("hsextract", run_name="__main__")
"""


def worker(model_dir: Path, data: Path, out: Path, layers: str, budget: int, *extra: str,
           random_weights: bool = True, env: dict | None = None, device: str = "cuda",
           keep_first: bool = False, state_checks: bool = True) -> dict:
    """`hsextract extract` over the whole dataset (random weights, SEED, unless `random_weights` is False:
    then the checkpoint in `model_dir`); its batch files are deleted once journaled (but the first, with
    `keep_first`), so the disk never holds more than a few; without `state_checks`, the worker of before issue
    38 (no per-layer sums or zero/constant row counts: `NO_STATE_CHECKS`). Its summary, with `steady` (tok/s after
    its first file) and `first_file_s` (process start to the first file journaled) added."""
    import threading

    run = ["-m", "hsextract"] if state_checks else ["-c", NO_STATE_CHECKS]
    cmd = [sys.executable, *run, "extract", "--model", str(model_dir), "--data", str(data),
           "--out", str(out), "--layers", layers, "--shard", "0", "--num-shards", "1", "--device", device,
           "--token-budget", str(budget), "--progress", "log", "--max-length", "4096",
           *(("--random-weights", str(SEED)) if random_weights else ()), *extra]
    paths = [str(ROOT / "src"), *(() if state_checks else (str(ROOT / "benchmarks"),)), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
    began = time.time()
    done = threading.Event()
    files: list[dict] = []

    def janitor():  # what the worker journaled is durable and measured: its bytes can go
        seen = 0
        while not done.wait(0.5):
            for journal in out.glob("shard-*/journal.jsonl"):
                lines = journal.read_text().splitlines()
                for line in lines[seen:]:
                    entry = json.loads(line) if line.endswith("}") else {}
                    if entry.get("kind") == "file":
                        files.append(entry)
                        if not (keep_first and len(files) == 1):
                            (journal.parent / entry["file"]).unlink(missing_ok=True)
                seen = len(lines) if lines and lines[-1].endswith("}") else max(0, len(lines) - 1)

    cleaner = threading.Thread(target=janitor, daemon=True)
    cleaner.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        done.set()
        cleaner.join()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    summary["log"] = [line for line in proc.stderr.splitlines() if line.startswith("hsextract:")]
    summary["steady"], summary["first_file_tokens"] = steady_state(out)
    journaled = sorted(e["time"] for e in files)
    summary["first_file_s"] = round(journaled[0] - began, 1) if journaled else None
    return summary


def steady_state(out: Path) -> tuple[float, int]:
    """tok/s between the first and the last file landing (the journal's times): start-up and the first
    batch's kernel compilation excluded, as they are from the ceilings; and the first file's tokens."""
    entries = [json.loads(line) for path in out.glob("shard-*/journal.jsonl") for line in path.open()]
    files = sorted((e for e in entries if e.get("kind") == "file"), key=lambda e: e["time"])
    if len(files) < 3:
        return 0.0, 0
    return sum(e["tokens"] for e in files[1:]) / (files[-1]["time"] - files[0]["time"]), files[0]["tokens"]


def same_batches(every: list, batch_s: list[float], skip_tokens: int) -> float:
    """The bare forward's rate over the batches after the first `skip_tokens` tokens (the worker's first file:
    its batches, in the worker's order), from each batch's device time: the ceiling for exactly the work the
    worker's steady state counts. A batch's cost per token depends on its lengths."""
    seen, first = 0, len(every)
    for i, batch in enumerate(every):
        if seen >= skip_tokens:
            first = i
            break
        seen += sum(len(s) for s in batch)
    rest = every[first:]
    return sum(len(s) for b in rest for s in b) / sum(batch_s[first:]) if rest else 0.0


def naive(model_dir: Path, data: Path, out: Path, layer_ids: list[int], n: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for _, line in zip(range(n), data.open())]
    tokens = 0
    with torch.inference_mode():
        model(input_ids=torch.tensor([records[0]["input_ids"][:64]], device="cuda"))  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for record in records:
            ids = torch.tensor([record["input_ids"]], device="cuda")
            result = model(input_ids=ids, output_hidden_states=True)
            states = torch.cat([result.hidden_states[i + 1][0] for i in layer_ids], dim=-1).cpu()
            torch.save({"hidden_states": states, "input_ids": ids.cpu(), "logits_dtype": str(result.logits.dtype)},
                       out / f"{record['id']}.pt")
            tokens += ids.shape[1]
        elapsed = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    shutil.rmtree(out)
    return tokens / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-layers", type=int, default=32)
    ap.add_argument("--layers", default="dflash:5")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--ceiling-batches", type=int, default=40,
                    help="packed batches the ceilings (bare forward, capture, sink) are measured over, spread "
                         "evenly over the run's batches, first to last")
    ap.add_argument("--sustained", action="store_true",
                    help="time the bare forward over all the run's batches (as long as the worker runs)")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the bare forward with transformers' reference causal convolution")
    ap.add_argument("--bare-only", action="store_true", help="only the bare forward and its MFU (e.g. at 64 layers)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for the MFU")
    ap.add_argument("--naive-samples", type=int, default=40)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=None, help="where files go (default: a temp dir); the sink")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--fp8", action="store_true", help="also run the worker with --out-dtype fp8_e4m3")
    ap.add_argument("--fp8-only", action="store_true", help="with --worker-only: the fp8_e4m3 worker alone")
    ap.add_argument("--compile", nargs="?", const="layers", choices=("layers", "mlp"), default=None,
                    help="also measure the bare forward with every decoder layer (or only every layer's MLP, "
                         "the linear-attention and attention modules left eager) under torch.compile")
    ap.add_argument("--worker-only", action="store_true",
                    help="only the worker (and with --fp8 its fp8 run): summaries, steady state, stage timings")
    ap.add_argument("--host-load", action="store_true",
                    help="also time the bare forward over the ceiling batches beside the worker's host work (copy "
                         "out, hash, write + fsync at its output rate), between two quiet timings")
    ap.add_argument("--kernels", default="default", choices=("default", "fused"),
                    help="the worker's --kernels, for the bare forward, the capture and the worker alike")
    ap.add_argument("--state-checks-ab", type=int, default=0, metavar="N",
                    help="with --worker-only: the bf16 worker with issue 38's state checks and without, N times each")
    ap.add_argument("--no-sink", action="store_true", help="skip the sink's figures (the ratio is to the GPU ceiling)")
    ap.add_argument("--oom-budget", type=int, default=0,
                    help="also run the worker with this huge token budget: it must split batches on CUDA OOM")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-gpu-tp-"))
    out = args.out or work / "out"
    started = time.perf_counter()
    model_dir = build_model(work / "model", args.model_layers)
    lengths = build_data(work / "data.jsonl", args.samples)
    layer_ids = parse_layer_spec(args.layers, args.model_layers)
    width = 5120 * len(layer_ids)
    print(f"model + data built in {time.perf_counter() - started:.0f}s: {args.model_layers} layers, capture "
          f"{layer_ids}, {args.samples} samples, {sum(lengths)} tokens (median {sorted(lengths)[len(lengths) // 2]},"
          f" max {max(lengths)}), {width * 2} bytes/token, token budget {args.token_budget}", flush=True)
    if args.worker_only:
        dtypes, runs = ((), ("--out-dtype", "fp8_e4m3")), {}
        todo = [(extra, True) for extra in (dtypes[1:] if args.fp8_only else dtypes[:2 if args.fp8 else 1])]
        if args.state_checks_ab:  # issue 38: the bf16 worker with its state checks and without, alternated
            # first a run that compiles the kernels for this data's shapes (a cold Triton cache), not counted
            todo = [((), None)] + [((), checks) for _ in range(args.state_checks_ab) for checks in (False, True)]
        for n, (extra, checks) in enumerate(todo):
            name = (" ".join(extra) or "bf16") + {None: ", warm-up (not counted)", True: "",
                                                  False: ", no state checks"}[checks]
            with phase(f"worker {name}"):
                summary = worker(model_dir, work / "data.jsonl", out, args.layers, args.token_budget, *extra,
                                 "--kernels", args.kernels, state_checks=checks is not False)
            print(f"worker {name}: {summary['tokens_per_s']:,.0f} tok/s over "
                  f"{summary['extract_s']} s, steady {summary['steady']:,.0f}, {summary['files']} files, "
                  f"{summary['bytes'] / 2**30:.2f} GiB, first file {summary['first_file_s']} s after start (load "
                  f"{summary.get('load_s')} s, warm-up {summary.get('warm_s')} s); "
                  f"pipeline {summary.get('pipeline')}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            runs[f"{n} {name}" if args.state_checks_ab else name] = summary
        if args.state_checks_ab:
            counted = {k: r for k, r in runs.items() if "warm-up" not in k}
            on = [r["tokens_per_s"] for k, r in counted.items() if "no state checks" not in k]
            off = [r["tokens_per_s"] for k, r in counted.items() if "no state checks" in k]
            on_s = [r["steady"] for k, r in counted.items() if "no state checks" not in k]
            off_s = [r["steady"] for k, r in counted.items() if "no state checks" in k]
            print(f"state checks, the worker's whole loop: with {', '.join(f'{v:,.0f}' for v in on)} tok/s, without "
                  f"{', '.join(f'{v:,.0f}' for v in off)}; mean with / without = {sum(on) / sum(off):.4f} (steady "
                  f"{sum(on_s) / sum(off_s):.4f})", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"workers": runs, "phases": PHASES}, indent=1))
        return 0
    every = batches(work / "data.jsonl", args.token_budget)
    real = sum(len(s) for b in every for s in b)
    padded = sum(padded_tokens(b) for b in every)
    # the ceilings are rates, measured over batches spread evenly over the whole run: the worker's batches go
    # longest first within each window of 1024 samples, and a batch's cost per token depends on its
    # lengths (attention grows with them; a delta-rule chunk is 64 tokens however short the samples)
    packed = spread(every, args.ceiling_batches)
    ceilings = bare_and_capture(model_dir, layer_ids, packed, args.bare_only, args.compile, not args.no_reference,
                                every if args.sustained else None, args.token_budget,
                                (out.parent / "load", width * 2) if args.host_load else None, args.kernels)
    bare_tps, capture_tps, params, made_s = (ceilings["bare"], ceilings.get("capture", 0.0), ceilings["params"],
                                             ceilings["made_s"])
    mfu = 2 * params * bare_tps / (args.peak_tflops * 1e12)
    torch.cuda.empty_cache()
    print(f"model made on the GPU in {made_s:.1f}s ({params / 1e9:.2f}B non-embedding parameters); kernels switched: "
          f"{ceilings['kernels'] or 'none'}; bare forward {bare_tps:,.0f} tok/s over "
          f"{len(every) if args.sustained else len(packed)} batches = "
          f"{2 * params * bare_tps / 1e12:.0f} TFLOP/s, MFU {mfu:.3f} of {args.peak_tflops:g}; capture "
          f"{capture_tps:,.0f} tok/s", flush=True)
    for name, (tps, err, warm) in ceilings["variants"].items():
        print(f"  bare forward, {name}: {tps:,.0f} tok/s, MFU {2 * params * tps / (args.peak_tflops * 1e12):.3f}, "
              f"{tps / bare_tps:.3f}x the worker's kernels; last layer rel err vs them {err:.2e}"
              + (f"; warm-up (compiles) {warm:.0f}s" if warm else ""), flush=True)
    if args.bare_only:
        if args.json:
            args.json.write_text(json.dumps({"bare": bare_tps, "params": params, "mfu": mfu, "made_s": made_s,
                                             "variants": ceilings["variants"], "host_load": ceilings.get("host_load"),
                                             "syncs": ceilings.get("syncs"),
                                             "phases": PHASES}))
        shutil.rmtree(work, ignore_errors=True)
        return 0
    bf16_bytes, fp8_bytes = width * 2, fp8_bytes_per_token(width, len(layer_ids))
    disk = ({k: float("inf") for k in (*CEILING_FIGURES, "ours", "zeros")} if args.no_sink else
            sink(out.parent / "sink", packed, bf16_bytes))
    raw_bps = max(disk[k] for k in CEILING_FIGURES)
    raw_tps, sink_tps = raw_bps / bf16_bytes, disk["ours"] / bf16_bytes
    print("sink (bf16 sizes): " + ", ".join(f"{k} {v / 2**30:.3f} GiB/s" for k, v in disk.items()), flush=True)
    with phase("worker bf16"):
        summary = worker(model_dir, work / "data.jsonl", out, args.layers, args.token_budget, "--kernels", args.kernels)
    worker_tps = summary["tokens_per_s"]
    steady_tps = summary["steady"]
    # the steady state's own ceiling: the bare forward over the same batches (those after the worker's first file)
    steady_ceiling = (same_batches(every, ceilings["batch_s"], summary["first_file_tokens"])
                      if "batch_s" in ceilings else 0.0)
    shutil.rmtree(out, ignore_errors=True)
    print(f"worker {worker_tps:,.0f} tok/s over {summary['extract_s']} s (steady {steady_tps:,.0f}; first file "
          f"{summary['first_file_s']} s after its start; load {summary.get('load_s')} s, warm-up "
          f"{summary.get('warm_s')} s), padding waste {summary.get('padding_waste')},"
          f" peak GPU {summary.get('peak_gpu_bytes', 0) / 2**30:.1f} GiB; pipeline {summary.get('pipeline')}", flush=True)
    fp8 = None
    if args.fp8:
        disk8 = ({k: float("inf") for k in (*CEILING_FIGURES, "zeros")} if args.no_sink else
                 sink(out.parent / "sink", packed, fp8_bytes, ours=False))
        raw8_tps = max(disk8[k] for k in CEILING_FIGURES) / fp8_bytes
        with phase("worker fp8"):
            fp8 = worker(model_dir, work / "data.jsonl", out, args.layers, args.token_budget, "--out-dtype", "fp8_e4m3",
                         "--kernels", args.kernels)
        fp8["ceiling"] = min(bare_tps, raw8_tps)
        fp8["steady_ceiling"] = min(same_batches(every, ceilings["batch_s"], fp8["first_file_tokens"]),
                                    raw8_tps) if "batch_s" in ceilings else 0.0
        shutil.rmtree(out, ignore_errors=True)
        print(f"fp8: sink {', '.join(f'{k} {v / 2**30:.3f} GiB/s' for k, v in disk8.items())}; worker "
              f"{fp8['tokens_per_s']:,.0f} tok/s (steady {fp8['steady']:,.0f}; first file {fp8['first_file_s']} s "
              f"after its start, "
              f"warm-up {fp8.get('warm_s')} s); pipeline {fp8.get('pipeline')}",
              flush=True)
    oom = None
    if args.oom_budget:
        oom = worker(model_dir, work / "data.jsonl", out, args.layers, args.oom_budget)
        shutil.rmtree(out, ignore_errors=True)
        print(f"OOM split: token budget {args.oom_budget:,} -> {oom['forward_passes']} forward passes, "
              f"{oom['samples_done']}/{oom['samples_total']} samples done, skipped {oom['skipped']}", flush=True)
    naive_tps = naive(model_dir, work / "data.jsonl", work / "naive", layer_ids, args.naive_samples) \
        if args.naive_samples else float("nan")
    ceiling = min(bare_tps, raw_tps)
    rows = [("bare forward (GPU ceiling)", bare_tps, bf16_bytes), ("capture, nothing copied out", capture_tps, bf16_bytes),
            ("sink: raw write+fsync, one file at a time", disk["serial"] / bf16_bytes, bf16_bytes),
            ("sink: raw, fsync of n overlaps write of n+1", disk["overlapped"] / bf16_bytes, bf16_bytes),
            (f"sink: raw, {LANES} threads writing + fsyncing", disk["parallel"] / bf16_bytes, bf16_bytes),
            ("sink: zero bytes, serial (not a ceiling)", disk["zeros"] / bf16_bytes, bf16_bytes),
            ("sink: the worker's write_batch, serial", sink_tps, bf16_bytes),
            ("worker end to end (whole loop)", worker_tps, bf16_bytes),
            ("worker steady state (after 1st file)", steady_tps, bf16_bytes),
            ("naive per-sample loop", naive_tps, bf16_bytes)]
    if fp8:
        rows += [("sink fp8: raw, the best of the three", raw8_tps, fp8_bytes),
                 ("worker fp8_e4m3 end to end", fp8["tokens_per_s"], fp8_bytes),
                 ("worker fp8_e4m3 steady state", fp8["steady"], fp8_bytes)]
    print(f"\n{'what':<46} {'tok/s':>10} {'GiB/s out':>10}")
    for name, tps, per_token in rows:
        print(f"{name:<46} {tps:>10,.0f} {tps * per_token / 2**30:>10.3f}")
    print(f"\nworker / min(GPU ceiling, sink ceiling) = {worker_tps / ceiling:.3f} over its whole extraction loop "
          f"(start-up kernels compiled on the first batches included), {steady_tps / ceiling:.3f} in steady state "
          f"(goals >= 0.95 and >= 0.98; the {'sink' if raw_tps < bare_tps else 'GPU'} is the ceiling; sink ceiling = "
          f"the best raw figure); bare forward MFU {mfu:.3f}")
    if fp8:
        print(f"fp8_e4m3: worker / min(GPU ceiling, fp8 sink ceiling) = {fp8['tokens_per_s'] / fp8['ceiling']:.3f} "
              f"whole loop, {fp8['steady'] / fp8['ceiling']:.3f} steady; {fp8['tokens_per_s'] / worker_tps:.2f}x the bf16 "
              f"worker ({fp8_bytes / bf16_bytes:.3f} of its bytes)")
    if steady_ceiling:
        print(f"steady state against the bare forward over the same batches (after the worker's first file, "
              f"{steady_ceiling:,.0f} tok/s from each batch's device time): bf16 "
              f"{steady_tps / min(steady_ceiling, raw_tps):.3f}"
              + (f", fp8_e4m3 {fp8['steady'] / fp8['steady_ceiling']:.3f}" if fp8 and fp8["steady_ceiling"] else ""))
        slow = sorted(ceilings["batch_s"])
        print(f"bare forward per batch: median {slow[len(slow) // 2] * 1e3:.0f} ms, slowest {slow[-1] * 1e3:.0f} ms, "
              f"sum {sum(slow):.1f} s of device time")
    print(f"worker / naive = {worker_tps / naive_tps:.1f}x")
    print(f"padding waste: this data {padded / real - 1:.4f} (planner), {summary.get('padding_waste')} (worker); "
          f"the planner on {PLANNER_SAMPLES:,} samples of the same distribution: {planner_waste(args.token_budget):.4f} "
          f"(goal <= 0.02; a sort window of 1024 needs more samples than this run has)")
    print(f"peak GPU memory (worker): {summary.get('peak_gpu_bytes', 0) / 2**30:.1f} GiB; "
          f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.json:
        args.json.write_text(json.dumps({"bare": bare_tps, "mfu": mfu, "params": params, "made_s": made_s,
                                         "capture": capture_tps, "sink": disk, "worker": worker_tps,
                                         "naive": naive_tps, "ratio": worker_tps / ceiling, "steady": steady_tps,
                                         "steady_ceiling": steady_ceiling, "batch_s": ceilings.get("batch_s"),
                                         "variants": ceilings["variants"], "kernels": ceilings["kernels"],
                                         "syncs": ceilings.get("syncs"),
                                         "summary": summary, "fp8": fp8, "oom": oom, "phases": PHASES,
                                         "warm_s": ceilings.get("warm_s")}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
