"""Tune the GPU kernels for every batch size while the model loads: on a thread of the worker (`WarmThread`,
the default on CUDA), or in child processes (`Prewarm`, with `--tune-procs N`).

fla's delta-rule cumsum kernels take the batch size as a Triton `constexpr` and autotune over 4-6 configs,
so every batch size compiles and benchmarks them anew: on a fresh H200, ~3 s per size, ~107 s for the 32
bucketed sizes of a budget of 8192 (benchmarks/RESULTS.md, issue 20). Triton keeps the compiled kernels and
(as fla asks) the autotune choices on disk (`~/.triton/cache`), so a later process on the host finds them.

`Prewarm.start` launches child processes (`python -m hsextract.run.prewarm`) before the worker loads its weights.
Each builds one linear-attention module of each kind from the model's config (random weights, nothing read
but config.json) and runs it for its share of the sizes, filling the on-disk caches while the parent reads
its checkpoint. The first child runs its first size alone: that tunes the kernels whose choice does not
depend on the batch size (the costly ones) without other processes' kernels in its timings; the others
wait for its signal, then find those choices on disk. The parent then runs `LayerCapture.warm_up` as
before, which finds the kernels ready. A child that fails or is slow costs nothing but its time: the
parent's own warm-up tunes whatever is missing.

Measured on an H100 (benchmarks/RESULTS.md, issue 20, fifth session): on an untuned host 8 children took
140 s to tune what the worker alone tunes in 120 s after its load, and slowed the load by 5.6 s (first file
160 s after the start against 154 s without them). So the worker starts none unless `--tune-procs N` asks.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, cast

import torch
from torch import nn

from hsextract.options import DEFAULT_KERNELS

#: shortest sample the warm-up plans for: batch sizes up to token_budget // SHORTEST are tuned
SHORTEST = 16
#: most child processes per worker (a host runs one worker per GPU)
MAX_PROCS = 8


def linear_attention_modules(backbone: nn.Module) -> list[nn.Module]:
    """The first linear-attention module (`layer.linear_attn`) of each kind in a decoder stack."""
    found: dict[type, nn.Module] = {}
    for layer in cast(nn.ModuleList, backbone.layers):
        module = getattr(layer, "linear_attn", None)
        if module is not None:
            found.setdefault(type(module), module)
    return list(found.values())


@torch.inference_mode()
def run_sizes(modules: list[nn.Module], sizes: list[int], token_budget: int, hidden_size: int,
              device: torch.device, dtype: torch.dtype) -> None:
    """Run each module once per batch size, on random input of min(64, budget // size) tokens per sample."""
    for size in sizes:
        width = max(1, min(64, token_budget // size))
        hidden_BTH = torch.randn(size, width, hidden_size, device=device, dtype=dtype)
        for module in modules:
            module(hidden_BTH)


def standalone_modules(model_dir: Path, device: torch.device, dtype: torch.dtype,
                       kernels: str = DEFAULT_KERNELS) -> tuple[list[nn.Module], int]:
    """One linear-attention module of each kind of `model_dir`'s model, alone on `device` with random weights
    (the model is laid out on the meta device: no memory, no weights read), on the worker's `kernels`; and the
    hidden size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hsextract.data.model import decoder_backbone
    from hsextract.run.kernels import apply_kernels

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    modules = linear_attention_modules(decoder_backbone(model))
    for module in modules:
        module.to_empty(device=device)
        with torch.no_grad():
            for param in module.parameters():
                param.normal_(0.0, 0.02)
        apply_kernels(module, device, kernels)
    return modules, config.get_text_config().hidden_size


def shares(sizes: list[int], procs: int) -> list[list[int]]:
    """`sizes` dealt round-robin to at most `procs` processes (none empty)."""
    procs = max(1, min(procs, len(sizes)))
    return [sizes[i::procs] for i in range(procs)] if sizes else []


def default_procs() -> int:
    """One child per two cores this process may run on, at most MAX_PROCS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_PROCS, cores // 2))


def tuned_marker(model_dir: Path, sizes: list[int], device: str, dtype: torch.dtype,
                 kernels: str = DEFAULT_KERNELS) -> Path | None:
    """A file in Triton's cache directory that says this host tuned these sizes for this model's shapes, GPU and
    software (written once every size is tuned; gone with the cache if it is wiped). None without a config."""
    try:
        config = (Path(model_dir) / "config.json").read_text()
    except OSError:
        return None
    versions = {}
    for name in ("torch", "triton", "fla-core", "flash-linear-attention", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    gpu = torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda") else str(device)
    key = json.dumps({"config": config, "sizes": sizes, "dtype": str(dtype), "gpu": gpu, "versions": versions,
                      **({"kernels": kernels} if kernels != DEFAULT_KERNELS else {})}, sort_keys=True)
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return cache / "hsextract-tuned" / hashlib.sha256(key.encode()).hexdigest()[:32]


def mark_tuned(marker: Path | None) -> None:
    """Write `tuned_marker`'s file (best effort: a read-only cache only costs the next start its tuning)."""
    if marker is not None:
        with contextlib.suppress(OSError):
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()


class Prewarm:
    """The child processes tuning kernels for a worker; `wait` says how it went."""

    def __init__(self, procs: list[tuple[list[str], subprocess.Popen, IO[bytes]]], started: float, ready: Path):
        self.procs = procs
        self.started = started
        self.ready = ready  # the first child's signal file, in a directory of its own
        self.seconds: float | None = None
        self.failures: list[str] = []

    @classmethod
    def start(cls, model_dir: Path, sizes: list[int], token_budget: int, device: str, dtype: torch.dtype,
              procs: int, kernels: str = DEFAULT_KERNELS) -> Prewarm:
        """Launch up to `procs` children, each tuning its share of `sizes`; they inherit this process's
        environment (CUDA_VISIBLE_DEVICES, caches) and process group (a stop of the worker stops them)."""
        package_root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                           if p)}
        children: list[tuple[list[str], subprocess.Popen, IO[bytes]]] = []
        ready = Path(tempfile.mkdtemp(prefix="hsextract-tune-")) / "first-size-done"
        for share in shares(sizes, procs):
            cmd = [sys.executable, "-m", "hsextract.run.prewarm", "--model", str(model_dir), "--device", str(device),
                   "--dtype", str(dtype).removeprefix("torch."), "--token-budget", str(token_budget),
                   "--sizes", ",".join(map(str, share)), "--kernels", kernels]
            first = children[0][1].pid if children else None
            cmd += ["--ready", str(ready)] if first is None else ["--after", str(ready), "--after-pid", str(first)]
            log = tempfile.TemporaryFile()  # what it printed, read only if it fails
            children.append((cmd, subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                   env=env), log))
        return cls(children, time.monotonic(), ready)

    def wait(self, timeout: float) -> float:
        """Wait for every child, at most `timeout` seconds from their start (the slow ones are killed);
        returns the seconds from their start to the last one's end, and records each failure."""
        for cmd, proc, log in self.procs:
            try:
                proc.wait(max(0.0, self.started + timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                self.failures.append(f"killed after {timeout:.0f}s: {' '.join(cmd[2:])}")
                continue
            if proc.returncode != 0:
                log.seek(0)
                printed = log.read().decode(errors="replace").strip().splitlines()[-3:]
                self.failures.append(f"exit {proc.returncode}: {' '.join(cmd[2:])}: {' | '.join(printed)[-400:]}")
            log.close()
        self.seconds = time.monotonic() - self.started
        self._clean()
        return self.seconds

    def _clean(self) -> None:
        self.ready.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.ready.parent.rmdir()

    def kill(self) -> None:
        """Stop every child now (the worker is failing before its warm-up)."""
        for _cmd, proc, log in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        self._clean()


class WarmThread:
    """The kernels tuned (or, on a tuned host, loaded from Triton's cache) for every batch size on a thread of the
    worker while its model loads, on `standalone_modules` built before the load starts (on the caller's
    thread: transformers' model building sets process-wide state, such as torch's default dtype, that the
    load sets too). The thread only runs those modules, and the load mostly waits on the disk, so the two
    overlap; the worker's own `warm_up` after the load then finds every size done. `Prewarm`'s interface:
    `wait`, `kill`, `seconds`, `failures`, `procs` (none)."""

    procs: tuple = ()

    def __init__(self, modules: list[nn.Module], sizes: list[int], token_budget: int, hidden_size: int,
                 device: torch.device, dtype: torch.dtype):
        self.started = time.monotonic()
        self.seconds: float | None = None
        self.failures: list[str] = []
        self.sizes_done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(modules, sizes, token_budget, hidden_size, device,
                                                                  dtype), name="hsextract-warm", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, model_dir: Path, sizes: list[int], token_budget: int, device: str,
              dtype: torch.dtype, kernels: str = DEFAULT_KERNELS) -> WarmThread:
        dev = torch.device(device)
        modules, hidden_size = standalone_modules(model_dir, dev, dtype, kernels)
        return cls(modules, sizes, token_budget, hidden_size, dev, dtype)

    def _run(self, modules, sizes, token_budget, hidden_size, device, dtype) -> None:
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                for size in sizes:
                    if self._stop.is_set():
                        return
                    run_sizes(modules, [size], token_budget, hidden_size, device, dtype)
                    self.sizes_done += 1
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - the worker's own warm-up tunes what is left, and fails if it must
            self.failures.append(f"{type(exc).__name__}: {str(exc)[-400:]}")
        finally:
            modules.clear()  # their memory goes with the thread's last reference

    def wait(self, timeout: float) -> float:
        """Wait for the thread, at most `timeout` seconds from its start (then it is told to stop after the size
        under way, and counted failed); the seconds from its start to its end."""
        self._thread.join(max(0.0, self.started + timeout - time.monotonic()))
        if self._thread.is_alive():
            self.failures.append(f"not done after {timeout:.0f}s: {self.sizes_done} size(s) tuned")
            self.kill(wait=True)  # the worker's own warm-up must not tune beside it
        self.seconds = time.monotonic() - self.started
        return self.seconds

    def kill(self, wait: bool = False) -> None:
        """Stop after the size under way (a kernel's tuning cannot be interrupted): with `wait`, wait for that;
        else at most a second (the worker is failing or stopping: the daemon thread ends with it)."""
        self._stop.set()
        self._thread.join(None if wait else 1.0)


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hsextract.run.prewarm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--token-budget", type=int, required=True)
    ap.add_argument("--sizes", required=True, help="batch sizes, comma-separated")
    ap.add_argument("--kernels", default=DEFAULT_KERNELS, help="the worker's --kernels")
    ap.add_argument("--ready", type=Path, help="create this file once the first size is done")
    ap.add_argument("--after", type=Path, help="run the sizes once this file exists...")
    ap.add_argument("--after-pid", type=int, help="...or this process has ended")
    args = ap.parse_args(argv)
    started = time.monotonic()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    modules, hidden_size = standalone_modules(args.model, device, dtype, args.kernels)
    if args.after:
        while not args.after.exists() and (args.after_pid is None or alive(args.after_pid)):
            time.sleep(0.05)
    for i, size in enumerate(sizes):
        run_sizes(modules, [size], args.token_budget, hidden_size, device, dtype)
        if i == 0 and args.ready:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            args.ready.touch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"tuned {len(modules)} module kind(s) for {len(sizes)} batch sizes in {time.monotonic() - started:.1f}s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
