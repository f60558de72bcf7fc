"""Where a full-depth forward's time goes on the GPU, op class by op class, and what each lever gives, in one run.

    PYTHONPATH=src python3 benchmarks/gpu_profile.py [--model-layers 64] [--levers all] [--json OUT.json]
    PYTHONPATH=src python3 benchmarks/gpu_profile.py --tiny --device cpu      # the plumbing, on a CPU

The model is the Qwen3.6-27B shape of gpu_throughput.py (hidden 5120, 48 Gated DeltaNet + 16 full-attention
layers at 64), made on the GPU from one seed (no checkpoint), and the batches are the worker's own: the same
lognormal dataset packed by `hsextract.run.batching.pack` under the token budget, `--timed-batches` of them spread
over the whole run. Prints, in this order:

  - the bare forward (nothing captured) over those batches: tok/s, TFLOP/s (2 x non-embedding parameters x real
    tokens) and MFU against `--peak-tflops` (989: H100/H200 SXM dense bf16); timed twice, for the noise;
  - the profile table: torch.profiler over `--profile-batches` batches, every GPU kernel attributed to the
    module that launched it (forward hooks open a profiler range per module) and to the aten op around its
    launch; per op class (GEMMs of the MLP / Gated DeltaNet / attention projections, the GDN recurrence, the
    short convolution, full attention, norms, gating and activations, residual adds, copies, idle and launch
    gaps), its time per batch and share, kernels per batch, and its achieved TFLOP/s (matrix products and
    attention: FLOPs from the ops' shapes; the recurrence: from the chunked algorithm's count) or GB/s (bytes
    from the ops' input shapes, or the least a kernel must move); then the 15 costliest kernels;
  - each lever beside the baseline on the same model and batches: tok/s, its ratio to the baseline, and the
    last layer's state on one batch against the baseline's (equal to the bit, or the relative error), then the
    profile table with every fused lever on. Levers: `grouped` (fla's delta rule given q/k at their own head
    count, no repeat_interleave), `norms` (RMSNorm and gated RMSNorm fused), `swiglu` (silu * up fused),
    `merged` (gate and up as one GEMM, then swiglu), `fused` (all four), `budget` (`fused` at twice the token
    budget), `sdpa-<backend>` (`fused` with SDPA held to one backend: flash, cudnn, efficient), `chunk32`
    (`fused` with fla's chunk size 32), `graphs` (`fused`, each batch shape's forward captured once in a CUDA
    graph and replayed).

Every figure comes from the one process and GPU that ran it; `--json` keeps them all (and the trace's table).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hsextract.run import kernels
from hsextract.run.capture import LayerCapture

from gpu_throughput import SEED, batches, build_data, build_model, spread  # benchmarks/ is the script's folder

LEVERS = ("grouped", "norms", "merged", "fused", "budget", "sdpa-cudnn", "sdpa-flash", "graphs", "chunk32", "swiglu",
          "sdpa-efficient")  # the order they run in: what the profile points at first
FUSED = ("grouped", "norms", "merged")  # `fused`: every switch that rounds no worse (swiglu is inside merged)

#: op classes of the profile table, in its order
CLASSES = ("GEMM: MLP", "GEMM: GDN projections", "GEMM: attention projections", "GDN recurrence (fla)",
           "short convolution", "full attention", "norms", "gating and activations", "residual adds",
           "copies and layout", "other", "idle and launch gaps")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_scaled_mm"}
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
COPY_OPS = {"aten::copy_", "aten::contiguous", "aten::clone", "aten::cat", "aten::repeat_interleave",
            "aten::index_select", "aten::index", "aten::_to_copy", "aten::fill_", "aten::zero_", "aten::zeros"}
ELEMENT_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8, "int": 4, "bool": 1,
                 "unsigned char": 1, "c10::Float8_e4m3fn": 1}


def tiny_model(out: Path, layers: int) -> Path:
    """The 27B shape scaled down (CPU plumbing runs): the same layer kinds and head structure."""
    from transformers import Qwen3_5TextConfig

    from hsextract import tiny

    tiny.build_tokenizer(out)
    Qwen3_5TextConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=4, max_position_embeddings=8192,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2).save_pretrained(out)
    return out


class ModuleRanges:
    """A profiler range around every forward of the modules whose class names end in one of `kinds`, named
    `mod:<kind>`: the kernels a module launches fall inside its range in the trace."""

    KINDS = ("GatedDeltaNet", "Attention", "MLP", "RMSNormGated", "RMSNorm", "DecoderLayer")

    def __init__(self, model: torch.nn.Module):
        self.handles = []
        for module in model.modules():
            kind = next((k for k in self.KINDS if type(module).__name__.endswith(k)), None)
            if kind is None:
                continue
            ranges: list = []

            def enter(_m, _args, kind=kind, ranges=ranges):
                ranges.append(torch.autograd.profiler.record_function(f"mod:{kind}"))
                ranges[-1].__enter__()

            def leave(_m, _args, _out, ranges=ranges):
                ranges.pop().__exit__(None, None, None)

            self.handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _shape_numbers(args: dict) -> tuple[list, list]:
    return args.get("Input Dims") or [], args.get("Input type") or []


def op_flops(name: str, args: dict) -> float:
    """FLOPs of a matrix product or attention op from its input shapes (0 when it is neither or they are unknown)."""
    dims, _ = _shape_numbers(args)
    try:
        if name in ("aten::mm", "aten::_scaled_mm") and len(dims) >= 2:
            (m, k), (_, n) = dims[0], dims[1]
            return 2.0 * m * k * n
        if name == "aten::addmm" and len(dims) >= 3:
            (m, k), (_, n) = dims[1], dims[2]
            return 2.0 * m * k * n
        if name == "aten::bmm" and len(dims) >= 2:
            (b, m, k), (_, _, n) = dims[0], dims[1]
            return 2.0 * b * m * k * n
        if any(a in name for a in ATTENTION_OPS) and len(dims) >= 2 and len(dims[0]) == 4:
            b, h, tq, d = dims[0]
            tk = dims[1][2]
            return 4.0 * b * h * tq * tk * d * 0.5  # causal: half the score matrix
    except (TypeError, ValueError, IndexError):
        pass
    return 0.0


def op_bytes(args: dict) -> float:
    """Bytes an elementwise-like op moves, estimated from its inputs: every tensor input read once, and an output
    the size of the largest written once."""
    dims, types = _shape_numbers(args)
    sizes = []
    for shape, kind in zip(dims, types):
        if isinstance(shape, list) and shape and kind in ELEMENT_BYTES:
            n = 1
            for x in shape:
                n *= x
            sizes.append(n * ELEMENT_BYTES[kind])
    return float(sum(sizes) + max(sizes)) if sizes else 0.0


def classify(kernel: str, module: str | None, op: str | None) -> str:
    op = op or ""
    if op in GEMM_OPS or any(g in kernel.lower() for g in ("gemm", "nvjet", "xmma", "cutlass_80", "cublas")):
        return {"MLP": "GEMM: MLP", "GatedDeltaNet": "GEMM: GDN projections",
                "Attention": "GEMM: attention projections"}.get(module, "other")
    if any(a in op for a in ATTENTION_OPS) or any(a in kernel.lower() for a in ("flash", "fmha", "attention")):
        return "full attention"
    if module in ("RMSNorm", "RMSNormGated") or "layer_norm" in kernel:
        return "norms"
    if "conv1d" in kernel or "conv" in op:
        return "short convolution"
    if module == "GatedDeltaNet" and not op.startswith("aten::") and any(
            k in kernel for k in ("chunk", "solve_tril", "recompute_w_u", "l2norm", "cumsum", "merge_16x16",
                                  "wy_fast", "kkt")):
        return "GDN recurrence (fla)"
    if op in COPY_OPS:
        return "copies and layout"
    if module == "DecoderLayer" and op in ("aten::add", "aten::add_"):
        return "residual adds"
    if module in ("MLP", "GatedDeltaNet", "Attention") or "swiglu" in kernel or "swish" in kernel:
        return "gating and activations"
    return "other"


def read_trace(path: Path) -> list[dict]:
    """Every GPU kernel of a chrome trace with its launching module range and aten op: [{name, ts, dur, module,
    op, args}]. A kernel's launch (a runtime event with its correlation id) lies inside the ranges and ops that
    were open on the launching thread; the innermost of each kind is taken."""
    events = json.loads(path.read_text())["traceEvents"]
    kernels_by_corr, launches, spans = {}, [], collections.defaultdict(list)
    for e in events:
        cat = e.get("cat", "")
        if e.get("ph") != "X":
            continue
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels_by_corr[e.get("args", {}).get("correlation")] = e
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            launches.append(e)
        elif cat in ("cpu_op", "user_annotation"):
            spans[(e["pid"], e["tid"])].append(e)
    for tid in spans:
        spans[tid].sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    out = []
    by_thread = collections.defaultdict(list)
    for launch in launches:
        by_thread[(launch["pid"], launch["tid"])].append(launch)
    for tid, these in by_thread.items():
        these.sort(key=lambda e: e["ts"])
        stack: list[dict] = []
        opened = spans.get(tid, [])
        i = 0
        for launch in these:
            while i < len(opened) and opened[i]["ts"] <= launch["ts"]:
                while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < opened[i]["ts"]:
                    stack.pop()
                stack.append(opened[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < launch["ts"]:
                stack.pop()
            kernel = kernels_by_corr.get(launch.get("args", {}).get("correlation"))
            if kernel is None:
                continue
            inside = [s for s in stack if s["ts"] + s.get("dur", 0) >= launch["ts"]]
            module = next((s["name"][4:] for s in reversed(inside) if s["name"].startswith("mod:")), None)
            op = next((s for s in reversed(inside) if s.get("cat") == "cpu_op"), None)
            out.append({"name": kernel["name"], "ts": kernel["ts"], "dur": kernel.get("dur", 0), "module": module,
                        "op": op["name"] if op else None, "args": op.get("args", {}) if op else {},
                        "op_id": (tid, op["ts"]) if op else None,
                        "kind": kernel.get("cat")})
    return out


def busy_union(kernels: list[dict]) -> tuple[float, float]:
    """(window, busy) in microseconds: from the first kernel's start to the last one's end, and the time in
    it that some kernel ran."""
    if not kernels:
        return 0.0, 0.0
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy += hi - lo
            lo, hi = a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    return spans[-1][1] - spans[0][0] if spans else 0.0, busy


def gdn_numbers(config, tokens: int) -> tuple[float, float]:
    """(FLOPs, least bytes) of the chunked gated delta rule over `tokens` tokens of one layer (chunk C = 64):
    per chunk and value head, K K^T and Q K^T (C x C x dk each), the WY solve's products (C x C x (dk + dv)),
    the state's use and update (2 x C x dk x dv) and the output's intra-chunk product (C x C x dv): per token
    2 x (2 C dk + C (dk + dv) + 2 dk dv + C dv). Bytes: q and k at the key heads, v and the output at the value
    heads (bf16), g and beta (fp32), each once."""
    c, dk, dv = 64, config.linear_key_head_dim, config.linear_value_head_dim
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    flops = tokens * hv * 2.0 * (2 * c * dk + c * (dk + dv) + 2 * dk * dv + c * dv)
    least = tokens * ((2 * hk * dk + 2 * hv * dv) * 2 + hv * 8)
    return flops, least


def profile_table(capture: LayerCapture, inputs: list[torch.Tensor], tokens: int, out: Path, label: str,
                  peak: float) -> dict:
    """Profile the bare forward over `inputs`; print and return the per-class table."""
    from torch.profiler import ProfilerActivity, profile

    ranges = ModuleRanges(capture.backbone)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with torch.inference_mode():
            capture.forward(inputs[0])  # the ranges' first forward outside the profile
            sync()
            with profile(activities=activities, record_shapes=True) as prof:
                for ids in inputs:
                    capture.forward(ids)
                sync()
    finally:
        ranges.remove()
    trace = out / f"trace-{label}.json"
    prof.export_chrome_trace(str(trace))
    ks = read_trace(trace)
    if not torch.cuda.is_available():  # the CPU plumbing run: the ops stand in for kernels
        ks = [{"name": e["name"], "ts": e["ts"], "dur": e.get("dur", 0), "module": None, "op": e["name"],
               "args": e.get("args", {}), "kind": "cpu"} for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("cat") == "cpu_op" and e.get("ph") == "X"][:2000]
    n = len(inputs)
    window, busy = busy_union(ks)
    rows = {c: {"us": 0.0, "kernels": 0, "flops": 0.0, "bytes": 0.0} for c in CLASSES}
    by_name = collections.defaultdict(lambda: [0.0, 0, ""])
    counted: set = set()
    config = capture._text_config
    for k in ks:
        cls = classify(k["name"], k["module"], k["op"])
        row = rows[cls]
        row["us"] += k["dur"]
        row["kernels"] += 1
        first = k.get("op_id") is None or k["op_id"] not in counted  # an op of several kernels counts once
        counted.add(k.get("op_id"))
        if first:
            row["flops"] += op_flops(k["op"] or "", k["args"])
            if not cls.startswith("GEMM") and cls != "full attention":
                row["bytes"] += op_bytes(k["args"])
        entry = by_name[k["name"][:90]]
        entry[0] += k["dur"]
        entry[1] += 1
        entry[2] = cls
    rows["idle and launch gaps"]["us"] = max(0.0, window - busy)
    gdn_layers = sum(1 for layer in capture.backbone.layers if getattr(layer, "linear_attn", None) is not None)
    flops, least = gdn_numbers(config, tokens) if gdn_layers else (0.0, 0.0)
    rows["GDN recurrence (fla)"]["flops"] = flops * gdn_layers
    rows["GDN recurrence (fla)"]["bytes"] = least * gdn_layers
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
        config.linear_num_value_heads * config.linear_value_head_dim if gdn_layers else 0
    if rows["short convolution"]["bytes"] == 0:
        rows["short convolution"]["bytes"] = 2.0 * tokens * conv_dim * 2 * gdn_layers
    print(f"\nprofile ({label}): {n} batches, {tokens:,} tokens, {window / 1e3 / n:.1f} ms a batch on the GPU, "
          f"busy {busy / max(window, 1):.1%}", flush=True)
    print(f"{'op class':<30}{'ms/batch':>10}{'share':>8}{'kernels':>9}{'TFLOP/s':>9}{'GB/s':>8}")
    table = {}
    for cls in CLASSES:
        row = rows[cls]
        if row["us"] == 0 and cls != "idle and launch gaps":
            continue
        seconds = row["us"] / 1e6
        tflops = row["flops"] / seconds / 1e12 if row["flops"] and seconds else None
        gbs = row["bytes"] / seconds / 1e9 if row["bytes"] and seconds else None
        table[cls] = {"ms_per_batch": row["us"] / 1e3 / n, "share": row["us"] / max(window, 1),
                      "kernels_per_batch": row["kernels"] / n, "tflops": tflops, "gbs": gbs}
        print(f"{cls:<30}{row['us'] / 1e3 / n:>10.2f}{row['us'] / max(window, 1):>8.1%}{row['kernels'] / n:>9.0f}"
              f"{'' if tflops is None else f'{tflops:.0f}':>9}{'' if gbs is None else f'{gbs:.0f}':>8}")
    gemm_flops = sum(rows[c]["flops"] for c in CLASSES if c.startswith("GEMM"))
    gemm_s = sum(rows[c]["us"] for c in CLASSES if c.startswith("GEMM")) / 1e6
    if gemm_s:
        print(f"GEMMs together: {gemm_flops / gemm_s / 1e12:.0f} TFLOP/s ({gemm_flops / gemm_s / 1e12 / peak:.2f} of "
              f"the {peak:.0f} peak), {gemm_s / (window / 1e6):.1%} of the time")
    print("costliest kernels:")
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    for name, (us, count, cls) in top:
        print(f"  {us / 1e3 / n:8.2f} ms/batch {count // max(n, 1):5d}x  {cls:<26} {name}")
    return {"label": label, "batches": n, "tokens": tokens, "window_ms_per_batch": window / 1e3 / n,
            "busy": busy / max(window, 1), "classes": table,
            "top_kernels": [{"name": k, "ms_per_batch": v[0] / 1e3 / n, "count": v[1], "class": v[2]}
                            for k, v in top]}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def to_ids(batch: list[list[int]], device: torch.device) -> torch.Tensor:
    ids = torch.zeros(len(batch), max(len(s) for s in batch), dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s)] = torch.tensor(s)
    return ids.to(device)


class Graphs:
    """The bare forward captured once per input shape in a CUDA graph, then replayed (`run`)."""

    def __init__(self, capture: LayerCapture):
        self.capture, self.graphs = capture, {}
        self.pool = torch.cuda.graph_pool_handle()  # one pool: the graphs replay one at a time

    @torch.inference_mode()
    def run(self, ids: torch.Tensor) -> torch.Tensor:
        shape = tuple(ids.shape)
        if shape not in self.graphs:
            static = ids.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.capture.forward(static)  # warm on a side stream, as capture wants
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                result = self.capture.forward(static).last_hidden_state
            self.graphs[shape] = (graph, static, result)
        graph, static, result = self.graphs[shape]
        static.copy_(ids)
        graph.replay()
        return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-layers", type=int, default=64)
    ap.add_argument("--samples", type=int, default=1200, help="the dataset the batches are packed from")
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--timed-batches", type=int, default=8)
    ap.add_argument("--profile-batches", type=int, default=2)
    ap.add_argument("--levers", default="all", help=f"comma-separated, of: {', '.join(LEVERS)}; or all, or none")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="a small model of the same kinds (CPU plumbing runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds: no lever is started past this")
    args = ap.parse_args()
    began = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "levers": {}}

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    if torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name()
        with contextlib.suppress(OSError):
            results["smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu",
                 "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    import transformers

    fla_version = None
    with contextlib.suppress(Exception):
        import importlib.metadata
        fla_version = importlib.metadata.version("fla-core")
    results["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__, "fla": fla_version}
    print(json.dumps({k: results.get(k) for k in ("device", "smi", "versions")}), flush=True)
    work = Path(tempfile.mkdtemp(prefix="hsx-profile-"))
    model_dir = (tiny_model if args.tiny else build_model)(work / "model", args.model_layers)
    data = work / "data.jsonl"
    build_data(data, args.samples)
    packed_all = batches(data, args.budget)
    packed = spread(packed_all, args.timed_batches)
    device = torch.device(args.device)
    t0 = time.time()
    capture = LayerCapture(model_dir, [args.model_layers - 1], False, args.device, torch.bfloat16,
                           random_weights=SEED)
    for layer in capture.backbone.layers:
        layer._forward_hooks.clear()
    sync()
    params = sum(p.numel() for name, p in capture.backbone.named_parameters() if "embed_tokens" not in name)
    print(f"model: {args.model_layers} layers, {params / 1e9:.2f}B non-embedding parameters, made in "
          f"{time.time() - t0:.0f}s; kernels switched by the worker: {capture.kernels or 'none'}", flush=True)
    inputs = [to_ids(b, device) for b in packed]
    tokens = sum(len(s) for b in packed for s in b)
    padded = sum(max(len(s) for s in b) * len(b) for b in packed)
    print(f"{len(packed_all)} batches of the worker's packing (budget {args.budget}); timed: {len(packed)} of them, "
          f"{tokens:,} tokens ({padded / tokens - 1:.2%} padding), batch sizes {sorted({len(b) for b in packed})}",
          flush=True)
    results.update(params=params, tokens=tokens, padded=padded, batch_sizes=[len(b) for b in packed])

    def timed(run, over=inputs) -> float:
        with torch.inference_mode():
            sync()
            start = time.perf_counter()
            for ids in over:
                run(ids)
            sync()
        return time.perf_counter() - start

    def last_state(run, ids) -> torch.Tensor:
        with torch.inference_mode():
            return run(ids).last_hidden_state.clone() if not isinstance(run, Graphs) else run.run(ids).clone()

    bare = capture.forward
    t0 = time.time()
    timed(bare)  # compiles and tunes fla's kernels for these batch sizes
    print(f"first pass (compile, tune): {time.time() - t0:.0f}s", flush=True)
    base = [tokens / timed(bare) for _ in range(2)]
    flop_rate = [2.0 * params * r / 1e12 for r in base]
    results["baseline"] = {"tok_s": base, "tflops": flop_rate, "mfu": [f / args.peak_tflops for f in flop_rate]}
    print(f"BASELINE bare forward: {base[0]:,.0f} / {base[1]:,.0f} tok/s, {flop_rate[1]:.0f} TFLOP/s, MFU "
          f"{flop_rate[1] / args.peak_tflops:.3f}", flush=True)
    want = last_state(bare, inputs[0])
    save()
    prof_inputs = inputs[: args.profile_batches]
    prof_tokens = sum(len(s) for b in packed[: args.profile_batches] for s in b)
    results["profile_before"] = profile_table(capture, prof_inputs, prof_tokens, args.out, "baseline",
                                              args.peak_tflops)
    save()

    levers = LEVERS if args.levers == "all" else () if args.levers == "none" else tuple(args.levers.split(","))
    switches = {"grouped": kernels.grouped_delta_rule, "norms": kernels.fused_norms,
                "swiglu": kernels.fused_swiglu, "merged": kernels.merged_gate_up}
    sdpa = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION"}

    def apply(names) -> list[str]:
        kernels.restore_forwards(capture.backbone)
        said = []
        for name in names:
            said += switches[name](capture.backbone, device)
        return said

    for lever in levers:
        if time.time() - began > args.deadline:
            print(f"deadline: {lever} and the levers after it not run", flush=True)
            results["levers"][lever] = {"skipped": "deadline"}
            break
        t0 = time.time()
        fused = lever not in switches
        try:
            said = apply(FUSED if fused else (lever,))
            run, over, lever_tokens = bare, inputs, tokens
            holder = contextlib.nullcontext()
            if lever == "budget":
                more = spread(batches(data, 2 * args.budget), max(1, args.timed_batches // 2))
                over = [to_ids(b, device) for b in more]
                lever_tokens = sum(len(s) for b in more for s in b)
            elif lever.startswith("sdpa-"):
                from torch.nn.attention import SDPBackend, sdpa_kernel
                holder = sdpa_kernel(getattr(SDPBackend, sdpa[lever]))
            elif lever == "chunk32":
                import fla.ops.gated_delta_rule as gdr

                original = gdr.chunk_gated_delta_rule
                gdr.chunk_gated_delta_rule = lambda *a, **k: original(*a, **{**k, "chunk_size": 32})
                holder = contextlib.ExitStack()
                holder.callback(setattr, gdr, "chunk_gated_delta_rule", original)
            elif lever == "graphs":
                graphs = Graphs(capture)
                run = graphs.run
            with holder:
                timed(run, over)  # compile, tune, capture
                warm_s = time.time() - t0
                rate = lever_tokens / timed(run, over)
                got = last_state(graphs if lever == "graphs" else bare, inputs[0])
            equal = bool(torch.equal(got, want))
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            flops = 2.0 * params * rate / 1e12
            results["levers"][lever] = {"switched": said, "tok_s": rate, "x_baseline": rate / base[1],
                                        "mfu": flops / args.peak_tflops, "equal": equal, "rel_err": err,
                                        "warm_s": warm_s}
            print(f"LEVER {lever:<15} {rate:>9,.0f} tok/s  x{rate / base[1]:.3f}  MFU {flops / args.peak_tflops:.3f}"
                  f"  {'equal to the bit' if equal else f'rel err {err:.2e}'}  (warm {warm_s:.0f}s; {said})",
                  flush=True)
            if lever == "graphs":
                del graphs, run
        except Exception as exc:  # noqa: BLE001 - a measurement: say why it could not be made, go on
            results["levers"][lever] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"LEVER {lever}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        save()
    if levers and time.time() - began < args.deadline + 20:
        apply(FUSED)
        timed(bare, prof_inputs)  # compiled and tuned for these shapes first (a cold cache, a lever not run)
        results["profile_after"] = profile_table(capture, prof_inputs, prof_tokens, args.out, "fused",
                                                 args.peak_tflops)
    save()
    print(f"\nsummary: baseline MFU {results['baseline']['mfu'][1]:.3f}; " + "; ".join(
        f"{k} {v['mfu']:.3f}" for k, v in results["levers"].items() if "mfu" in v), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
