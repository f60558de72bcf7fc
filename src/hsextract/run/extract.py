"""One shard's extraction: assigned samples -> packed batches -> captured states -> journaled files."""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import torch

from hsextract import __version__
from hsextract.data.chat import ChatEncoder, Rejected, Tokenized
from hsextract.data.model import read_model_info
from hsextract.data.records import Bad, Record
from hsextract.errors import DegenerateStates, Interrupted, UsageError
from hsextract.options import DEFAULT_KERNELS, WorkerOptions
from hsextract.output.batchfile import build_payload
from hsextract.output.payload import Prepared
from hsextract.output.quant import FP8_ENCODING, SCALE_KEY, fp8_bytes_per_token, quantize
from hsextract.output.recipe import recipe_of
from hsextract.run.batching import batch_size_buckets, pack, padded_tokens
from hsextract.run.capture import LayerCapture, resolve_device, resolve_dtype
from hsextract.run.kernels import fused_available
from hsextract.run.layers import layers_to_load
from hsextract.run.liveness import Heartbeat, Progress
from hsextract.run.preload import Preload, start_preload
from hsextract.run.prewarm import SHORTEST, Prewarm, WarmThread, mark_tuned, tuned_marker
from hsextract.run.readahead import ReadAhead
from hsextract.run.shard import Shard, drive
from hsextract.run.writer import BAD_KEY, STATS_KEY, BatchWriter, writer_copier


class ShardRun(Shard):
    """Runs one shard to completion with the model; `run()` returns the summary or raises (the journal stays
    valid)."""

    def __init__(self, opts: WorkerOptions, progress: Progress, capture=LayerCapture,
                 read_ahead: ReadAhead | None = None):
        super().__init__(opts, progress)
        self.make_capture = capture  # the model's forward: a seam where tests inject faults (harness.faulty)
        self.read_ahead = read_ahead  # the checkpoint read into the page cache since the process start (cli)
        self.load_s: float | None = None  # making the model (read or built) and putting it on the device
        self.warm_s: float | None = None  # tuning the kernels for every batch size before the first batch (CUDA)
        self.prewarm: Prewarm | WarmThread | None = None  # what tuned them while the model loaded
        self.tuned: Path | None = None  # the file that says this host has tuned them (prewarm.tuned_marker)
        self.tuned_before = False  # it was there at the start: no tuning processes
        self.loop = ForwardLoopTimer(torch.device("cpu"))  # the forward loop's own timings (run() makes one)
        self.cuda_start_s: float | None = None  # making the CUDA context, on a thread (`CudaStart`)
        self.preload: Preload | None = None  # the weights read to the device beside the imports
        self.layer_ids: list[int] = []  # the captured layers (named when one is degenerate)
        self.width = 0  # values per token of the captured layers
        self.squares: list[float] = []  # per captured layer, the sum of squares of every state so far
        self.squared_tokens = 0

    # -- the run --------------------------------------------------------------------------------------
    def run(self, layer_ids: list[int]) -> dict:
        """Resume, then start-up -> the loop over the pending samples -> finish: the summary (journaled `done`)."""
        device, dtype = self.resolve()
        self.recipe = recipe_of(self.opts, layer_ids, str(dtype).removeprefix("torch."), kernels=self.opts.kernels)
        pending = self.begin()
        if not pending:
            self.stop_read_ahead()
            return self.finish()  # everything assigned is already written or skipped: no model needed
        with StartUp(self, layer_ids, device, dtype) as start:
            encoder, copier, early = start.prepare(pending)
            capture = start.load()
            start.tune(capture)
        first = early.result()
        self.progress.mark("first_window_tokenized")
        self.start_extracting(capture, layer_ids)
        self.extract_all(capture, encoder, pending, first, copier)
        if self.stop_signal:
            raise Interrupted(self.stop_signal)
        return self.finish()

    def resolve(self) -> tuple[str, torch.dtype]:
        """The device and dtype the options ask for, as they resolve here (UsageError when the kernels cannot run)."""
        device = resolve_device(self.opts.device)
        dtype = resolve_dtype(self.opts.dtype, device)
        if self.opts.kernels != DEFAULT_KERNELS and (why := fused_available(torch.device(device))):
            raise UsageError(f"--kernels {self.opts.kernels}: {why}")
        return device, dtype

    def start_extracting(self, capture: LayerCapture, layer_ids: list[int]) -> None:
        """The model is ready: the batch files' metadata, the phase `extracting`, the start-up's line."""
        opts = self.opts
        self.layer_ids, self.width = list(layer_ids), capture.width
        self.metadata = {
            "sample_ids": "", "layer_ids": json.dumps(layer_ids), "model": opts.model.name,
            "hidden_size": str(capture.hidden_size), "num_model_layers": str(capture.info.num_layers),
            "dtype": str(capture.dtype).removeprefix("torch."), "hsextract_version": __version__,
            **({"hidden_states_encoding": FP8_ENCODING} if opts.out_dtype == "fp8_e4m3" else {}),
            **({"random_weights": str(opts.random_weights)} if opts.random_weights is not None else {}),
            **self.recipe_metadata(),
        }
        self.progress.phase = "extracting"
        self.progress.extract_started_at = time.time()
        self.log.info(f"start-up, from the process start: {self.progress.describe_startup()}")

    def extract_all(self, capture: LayerCapture, encoder: ChatEncoder, pending: list[Record | Bad],
                    first: list[Tokenized | Rejected], copier) -> None:
        """The loop: pending records tokenized (the `first` already), packed, run, and written by the writer's
        threads, until the last or a stop signal; the writer drained in any case."""
        opts = self.opts
        writer = BatchWriter(self, capture.device, hash_workers=opts.hash_threads or None,
                             bytes_per_token=self.bytes_per_token(capture), token_budget=opts.token_budget,
                             copier=copier)
        self.loop = ForwardLoopTimer(capture.device)
        batches = pack(self.encoded(encoder, pending, first), opts.token_budget, opts.sort_window)
        try:
            while (batch := self.loop.next(batches)) is not None and not self.stop_signal:
                for part, states in self.forward(capture, batch):
                    writer.put(part, states)
        finally:
            try:
                writer.close()
            finally:
                self.extract_ended = time.time()
                self.pipeline = {**self.loop.timings(), **writer.timings()}

    def bytes_per_token(self, capture: LayerCapture) -> int:
        """Host bytes a token's states take on their way to a file (what a pinned set is sized from)."""
        return self.token_bytes(capture.layer_ids, capture.hidden_size, capture.dtype, capture.include_last)

    def token_bytes(self, layer_ids: list[int], hidden_size: int, dtype: torch.dtype, include_last: bool) -> int:
        """`bytes_per_token` of a capture of these layers, known before the model loads."""
        element = torch.empty(0, dtype=dtype).element_size()
        width = len(layer_ids) * hidden_size
        per = fp8_bytes_per_token(width, len(layer_ids)) if self.opts.out_dtype == "fp8_e4m3" else width * element
        if include_last:
            per += hidden_size * element
        return per + 1  # the non-finite flags: one per sample, at most one per token

    def stop_read_ahead(self) -> None:
        """Stop the read-ahead and the preload (the load has what it needs, or will not); their figures go to the
        summary."""
        if self.read_ahead is not None:
            self.read_ahead.stop()
        if self.preload is not None:
            self.preload.stop()

    def start_preload(self, keep_layers: int, device: str, dtype: torch.dtype) -> Preload | None:
        """The tensors of the checkpoint's first `keep_layers` layers (and the rest but lm_head) read into the
        device's memory on a thread while the worker goes on importing (`hsextract.run.preload`); None with
        --load-after-imports or --read-ahead-gb 0, for a model built from its seed, or where the load should read
        the files itself (it is said why)."""
        opts = self.opts
        if opts.random_weights is not None or opts.load_after_imports or opts.read_ahead_gb == 0:
            return None
        preload, why = start_preload(opts.model, keep_layers, device, dtype, follow=self.read_ahead)
        if preload is None:
            self.log.info(f"the weights are read after the imports, by transformers: {why}")
        return preload

    def start_prewarm(self, device: str, dtype: torch.dtype) -> Prewarm | WarmThread | None:
        """On CUDA, what tunes the kernels for every batch size while the model loads (`hsextract.run.prewarm`): with
        --tune-procs N, child processes (None when this host tuned the same sizes for the same shapes, GPU and
        software before: `tuned_marker`; on an H100 they did not shorten an untuned host's start,
        benchmarks/RESULTS.md, issue 20, fifth session); else a thread of this process (`WarmThread`), unless
        --warm-after-load."""
        opts, procs = self.opts, self.opts.tune_procs or 0
        sizes = batch_size_buckets(max(1, opts.token_budget // SHORTEST))
        if procs == 0:
            if opts.warm_after_load or torch.device(device).type != "cuda":
                return None
            try:
                return WarmThread.start(opts.model, sizes, opts.token_budget, device, dtype, opts.kernels)
            except Exception as exc:  # noqa: BLE001 - the warm-up after the load does it; the load tells of a bad model
                self.log.warning(f"warning: no kernel tuning beside the load ({type(exc).__name__}: {exc}); they "
                                 f"are tuned after it")
                return None
        self.tuned = tuned_marker(opts.model, sizes, device, dtype, opts.kernels)
        if self.tuned is not None and self.tuned.exists():
            self.log.info(f"kernels tuned on this host before ({self.tuned}): no tuning processes")
            self.tuned_before = True
            return None
        return Prewarm.start(opts.model, sizes, opts.token_budget, device, dtype, procs, opts.kernels)

    def encoded(self, encoder: ChatEncoder, pending: list[Record | Bad],
                first: Sequence[Tokenized | Rejected] = ()) -> Iterator[Tokenized]:
        """Tokenize the pending records (the first `len(first)` were: `EarlyTokens`); the ones that cannot train
        are journaled as skipped on the way."""
        for i, item in enumerate(pending):
            result = first[i] if i < len(first) else encode(encoder, item)
            if isinstance(result, Rejected):
                self.skip(result.id, result.reason, result.detail, item.line, counts_as_done=True)
            else:
                yield result

    def forward(self, capture: LayerCapture, batch: list[Tokenized]) -> Iterator[tuple[list[Tokenized], dict]]:
        """Run a batch; on out-of-memory split it in halves, and skip a single sample that still fails.

        Parts are yielded as they finish, so the writer takes each before the next runs. A retry happens
        only after the except block is left: its traceback holds the failed attempt's activations."""
        todo = [batch]
        while todo:
            part = todo.pop()
            try:
                with self.loop.forward():
                    states = capture.run([s.input_ids for s in part])
                    states[BAD_KEY], states[STATS_KEY] = self.check_states(part, states, len(capture.layer_ids))
                    if self.opts.out_dtype == "fp8_e4m3":  # after the NaN check, which needs the real values
                        states["hidden_states"], states[SCALE_KEY] = quantize(states["hidden_states"],
                                                                              capture.hidden_size)
                oom = None
            except torch.OutOfMemoryError as exc:
                oom, states = str(exc), None
            except RuntimeError as exc:  # the CPU's allocator says it in words of its own
                if not is_cpu_oom(exc):
                    raise
                oom, states = f"CPU out of memory: {exc}"[:300], None
            if oom is not None:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if len(part) == 1:
                    self.skip(part[0].id, "oom", f"{len(part[0])} tokens alone: {oom}"[:300], counts_as_done=True)
                else:
                    mid = len(part) // 2
                    todo += [part[mid:], part[:mid]]  # the first half runs next
                continue
            self.progress.forward_passes += 1
            self.progress.mark("first_forward")  # queued: on CUDA the device runs it meanwhile
            self.progress.padded_tokens += padded_tokens(part)
            self.progress.tokens_forwarded += sum(len(s) for s in part)
            assert states is not None  # no out-of-memory: the forward made them
            yield part, states
            states = None

    @staticmethod
    def check_states(batch: list[Tokenized], states: dict, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The checks of a batch's states on their device, with no host sync (the writer reads them with the batch):
        [B] bool, which samples have a NaN or Inf anywhere; and [layers, 3] float32, per captured layer the sum of
        squares of its states and how many tokens' rows are all zeros and constant.

        Two passes over the captured states, whatever their size: one row min and max (NaN propagates through
        both, an Inf is the min or the max: they also give the non-finite rows) and one sum of squares."""
        hidden_TW = states["hidden_states"]
        device = hidden_TW.device
        rows_TLH = hidden_TW.reshape(hidden_TW.shape[0], layers, -1)
        bottom_TL, top_TL = torch.aminmax(rows_TLH, dim=-1)
        bad_T = ~(torch.isfinite(bottom_TL) & torch.isfinite(top_TL)).all(dim=1)
        for key, tensor in states.items():
            if key != "hidden_states":
                bad_T |= ~torch.isfinite(tensor).all(dim=1)
        lengths = torch.tensor([len(s) for s in batch], pin_memory=device.type == "cuda").to(device, non_blocking=True)
        sample_of_T = torch.repeat_interleave(torch.arange(len(batch), device=device), lengths,
                                              output_size=sum(len(s) for s in batch))
        bad_B = torch.zeros(len(batch), device=device).index_add_(0, sample_of_T, bad_T.float()) > 0
        constant_TL = top_TL == bottom_TL
        zero_TL = constant_TL & (top_TL == 0)
        squares_L = torch.linalg.vector_norm(rows_TLH, dim=(0, 2), dtype=torch.float32).square()
        return bad_B, torch.stack([squares_L, zero_TL.sum(0).float(), constant_TL.sum(0).float()], dim=1)

    def check_layers(self, batch: list[Tokenized], stats: list[list[float]]) -> list[float | None]:
        """DegenerateStates naming the layer when a captured layer is all zeros, or constant, for every token of
        `batch`; else the per-layer RMS of the states so far (the heartbeat's `layer_rms`) takes it in, and the
        batch's own per-layer RMS is returned (journaled with its file; None where a state is not finite)."""
        tokens = sum(len(s) for s in batch)
        layer_ids = self.layer_ids or list(range(len(stats)))
        for layer, (_, zero, constant) in zip(layer_ids, stats):
            if tokens and (zero >= tokens or constant >= tokens):
                what = "all zeros" if zero >= tokens else "constant (one value per row)"
                raise DegenerateStates(
                    f"shard {self.opts.shard}/{self.opts.num_shards}: layer {layer}'s states are {what} for every "
                    f"one of the {tokens} tokens of a batch of {len(batch)} sample(s) (e.g. {batch[0].id}): a broken "
                    f"kernel or checkpoint, not a bad sample; nothing of it was stored")
        hidden = (self.width or 1) / max(1, len(stats))
        with self.counting:
            self.squares = [a + b[0] for a, b in zip(self.squares, stats)] if self.squares else [b[0] for b in stats]
            self.squared_tokens += tokens
            rms = [(q / (self.squared_tokens * hidden)) ** 0.5 for q in self.squares]
            self.progress.layer_rms = [_finite(r) for r in rms]
        return [_finite((b[0] / max(1, tokens * hidden)) ** 0.5) for b in stats]

    def drop_nonfinite(self, batch: list[Tokenized], states: dict, bad: list[bool]) -> tuple[list[Tokenized], dict]:
        """Skip (with a reason) the samples flagged by `check_states`; host tensors in, host tensors out."""
        if not any(bad):
            return batch, states
        lengths = torch.tensor([len(s) for s in batch])
        keep_T = torch.repeat_interleave(~torch.tensor(bad), lengths)
        for sample, b in zip(batch, bad):
            if b:
                self.skip(sample.id, "nonfinite_states", "NaN or Inf in captured hidden states", counts_as_done=True)
        return [s for s, b in zip(batch, bad) if not b], {k: v[keep_T] for k, v in states.items()}

    def prepare_file(self, batch: list[Tokenized], states: dict, hashed: bool = True) -> Prepared:
        """Name (in order), lay out and (if `hashed`) hash one batch file: CPU work, no I/O, the states not
        copied."""
        name = f"batch-{self.next_seq:06d}.safetensors"
        self.next_seq += 1
        lengths = [len(s) for s in batch]
        tensors = {
            **states,
            "input_ids": torch.tensor([t for s in batch for t in s.input_ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for s in batch for m in s.loss_mask], dtype=torch.uint8),
            "cu_seqlens": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
        }
        ids = [s.id for s in batch]
        metadata = {**self.metadata, "sample_ids": json.dumps(ids)}
        return Prepared(name, build_payload(tensors, metadata, hashed), ids, lengths,
                        provenance=provenance(batch))

    def summary_extra(self) -> dict:
        """The GPU's peak memory, the checkpoint's read-ahead, the model's load, the kernels' tuning and warm-up."""
        return {
            **({"read_ahead": self.read_ahead.summary()} if self.read_ahead is not None else {}),
            **({"preload": self.preload.summary()} if self.preload is not None else {}),
            **({"peak_gpu_bytes": torch.cuda.max_memory_allocated()} if torch.cuda.is_initialized() else {}),
            **({"cuda_start_s": round(self.cuda_start_s, 3)} if self.cuda_start_s is not None else {}),
            **({"load_s": round(self.load_s, 3)} if self.load_s is not None else {}),
            **({"warm_s": round(self.warm_s, 3)} if self.warm_s is not None else {}),
            **({"tune": {"procs": len(self.prewarm.procs), "seconds": round(cast(float, self.prewarm.seconds), 3),
                         "failed": len(self.prewarm.failures),
                         **({"thread": True} if isinstance(self.prewarm, WarmThread) else {})}} if self.prewarm else
               {"tune": {"procs": 0, "tuned_before": True}} if self.tuned_before else {}),
        }

def provenance(batch: list[Tokenized]) -> dict:
    """Per sample, the xxh3-64 of its token ids (int32, as the file holds them) and of the record it was made
    from: a trainer can check that states and tokens belong together, and a resume that a record changed."""
    import array

    import xxhash

    return {"tokens_xxh3": [xxhash.xxh3_64(array.array("i", s.input_ids).tobytes()).hexdigest() for s in batch],
            "records_xxh3": [getattr(s, "source", "") for s in batch]}


def is_cpu_oom(exc: BaseException) -> bool:
    """Whether `exc` is torch's CPU allocator running out of memory (named like a CUDA out-of-memory)."""
    text = str(exc)
    return "DefaultCPUAllocator" in text or "not enough memory" in text or "can't allocate memory" in text


def _finite(value: float) -> float | None:
    """`value` rounded for JSON, None when NaN or infinite (JSON has neither)."""
    return round(value, 6) if value == value and abs(value) != float("inf") else None


class ForwardLoopTimer:
    """Where the forward loop's time goes: `next_batch_s` waiting for the next batch (reading, tokenizing,
    packing), `forward_s` queuing forwards on the host; on CUDA also the device's side, from an event pair
    around each forward (never waited for: pairs are read once done, the rest at the end):
    `gpu_forward_s` the device spent in forwards, `gpu_idle_s` it had none to run between the first and the
    last (the host did not keep it fed)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spent: defaultdict[str, float] = defaultdict(float)
        self.pending: collections.deque = collections.deque()  # event pairs not read yet
        self.first = self.last = None  # the first forward's begin, the last one's end
        self.busy_ms = 0.0

    def next(self, batches: Iterator):
        started = time.monotonic()
        try:
            return next(batches, None)
        finally:
            self.spent["next_batch_s"] += time.monotonic() - started

    @contextlib.contextmanager
    def forward(self):
        started = time.monotonic()
        begin = end = None
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self.first = self.first or begin
        try:
            yield
        finally:
            if end is not None:
                end.record()
                self.pending.append((begin, end))
                self.last = end
                while self.pending and self.pending[0][1].query():  # done: read without waiting
                    self._read(*self.pending.popleft())
            self.spent["forward_s"] += time.monotonic() - started

    def _read(self, begin, end) -> None:
        self.busy_ms += begin.elapsed_time(end)

    def timings(self) -> dict:
        out = {k: round(v, 3) for k, v in sorted(self.spent.items())}
        if self.last is not None:
            try:
                self.last.synchronize()
                while self.pending:
                    self._read(*self.pending.popleft())
                busy, span = self.busy_ms / 1000, self.first.elapsed_time(self.last) / 1000
            except Exception:  # noqa: BLE001 - a failed device: the error that ended the loop is the one to tell
                return out
            out.update(gpu_forward_s=round(busy, 3), gpu_idle_s=round(max(0.0, span - busy), 3))
        return out


def encode(encoder: ChatEncoder, item: Record | Bad) -> Tokenized | Rejected:
    """A pending record's tokens, or why it is skipped (a record that did not parse is rejected as it was)."""
    return Rejected(item.id, item.reason, item.detail) if isinstance(item, Bad) else encoder.encode(item)


class CudaStart:
    """The CUDA context made on a thread (seconds on a cold host) while the caller goes on importing and loading
    the tokenizer; `wait` returns the seconds it took (None off CUDA) and raises what it raised. torch releases
    the GIL while the driver works."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self.thread = None
        if self.device.type == "cuda":
            self.thread = threading.Thread(target=self._run, name="hsextract-cuda-start", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            torch.empty(1, device=self.device)  # initialises CUDA and makes the device's primary context
        except BaseException as exc:  # noqa: BLE001 - raised on the worker's thread by `wait`
            self.error = exc
        self.seconds = time.monotonic() - started

    def wait(self) -> float | None:
        if self.thread is None:
            return None
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.seconds


class EarlyTokens:
    """The first records tokenized on a thread of their own while the model loads, so that the first batch is
    ready when the model is (a window of 1024 long conversations takes a second or more). Only the start: the
    rest is tokenized on the forward loop's thread as it needs them, as before (a thread tokenizing beside the
    loop would hold the GIL between the loop's kernel launches). The tokenizer is loaded and its chat path run
    once on the caller's thread first: transformers' lazy imports are not thread-safe, and the model's load
    goes on importing meanwhile."""

    def __init__(self, encoder: ChatEncoder, records: list[Record | Bad]):
        encoder.warm()
        self.encoder, self.records = encoder, records
        self.done: list[Tokenized | Rejected] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hsextract-tokenize", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.records:
                self.done.append(encode(self.encoder, item))
        except BaseException as exc:  # noqa: BLE001 - raised on the worker's thread by `result`
            self.error = exc

    def result(self) -> list[Tokenized | Rejected]:
        """The records' results, in order (waits for the thread); its error, raised here."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.done


class StartUp:
    """A shard's start-up, from the model's files to the first batch, and the pieces that run beside it: the CUDA
    context (`CudaStart`), the weights read to the device (`Preload`), the kernels' tuning (`Prewarm`,
    `WarmThread`), the first window tokenized (`EarlyTokens`). Owned here with their clean-up: leaving on an
    error kills the tuning processes; the read-ahead and the preload are stopped once the load has what it
    needs, or on the way out. Its steps, in order: `prepare`, `load`, `tune`."""

    def __init__(self, run: ShardRun, layer_ids: list[int], device: str, dtype: torch.dtype):
        self.run, self.opts, self.layer_ids, self.device, self.dtype = run, run.opts, layer_ids, device, dtype
        self.prewarm: Prewarm | WarmThread | None = None  # until tuned; then the run's (its summary)

    def __enter__(self) -> StartUp:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None and self.prewarm:
            self.prewarm.kill()  # the children go with this worker
        self.run.stop_read_ahead()

    def prepare(self, pending: list[Record | Bad]) -> tuple[ChatEncoder, object, EarlyTokens]:
        """Everything that starts beside the load: the CUDA context, the weights to the device, the tuning, the
        tokenizer (a broken one is told before the load), the writer's pinned sets, the first window's tokens.
        (encoder, the writer's host copier or None, the first window's tokens under way)."""
        run, opts = self.run, self.opts
        run.progress.phase = "loading_model"
        cuda = CudaStart(self.device)  # made while transformers, the model code, the tokenizer load
        if opts.random_weights is not None:
            run.log.warning(f"warning: --random-weights {opts.random_weights}: the weights of {opts.model} are "
                            f"not loaded; the states are of a random model")
        info = read_model_info(opts.model)
        run.preload = run.start_preload(layers_to_load(self.layer_ids, info.num_layers, opts.include_last),
                                        self.device, self.dtype)  # the weights to the device beside the imports
        self.prewarm = run.start_prewarm(self.device, self.dtype)  # imports the model's code; tunes beside the rest
        if self.prewarm:
            run.progress.mark("tuning_started")
        encoder = ChatEncoder(load_tokenizer(opts.model), info.vocab_size, info.max_length(opts.max_length),
                              opts.overlong)
        run.progress.mark("tokenizer_loaded")
        run.cuda_start_s = cuda.wait()
        copier = None
        if run.cuda_start_s is not None:
            run.progress.mark("device_ready")
            # the writer's pinned sets, pinned beside the load rather than beside the first batches' launches
            copier = writer_copier(torch.device(self.device), opts.hash_threads or None, run.token_bytes(
                self.layer_ids, info.hidden_size, self.dtype, opts.include_last), opts.token_budget)
        return encoder, copier, EarlyTokens(encoder, pending[:opts.sort_window])

    def load(self) -> LayerCapture:
        """The model on the device (from the preloaded weights where they were read), the read-ahead stopped."""
        run, opts = self.run, self.opts
        started = time.monotonic()
        try:
            capture = run.make_capture(opts.model, self.layer_ids, opts.include_last, self.device, self.dtype,
                                       random_weights=opts.random_weights,
                                       **({"preload": run.preload} if run.preload is not None else {}),
                                       **({"kernels": opts.kernels} if opts.kernels != DEFAULT_KERNELS else {}))
        finally:
            run.stop_read_ahead()  # done with the load, or with the worker
        run.load_s = time.monotonic() - started
        run.progress.mark("model_loaded")
        how = ", ".join(x for x in (getattr(capture, "load_path", ""), *getattr(capture, "kernels", ())) if x)
        run.log.info(f"model loaded in {run.load_s:.1f}s on {self.device}" + (f" ({how})" if how else ""))
        if run.preload is not None and not run.preload.taken:
            run.log.warning(f"warning: the weights read beside the imports were not used ("
                            f"{run.preload.error or 'the model class is not one transformers maps'}); "
                            f"transformers read the files")
        return capture

    def tune(self, capture: LayerCapture) -> None:
        """The tuning waited for, then (CUDA) the kernels warmed for every batch size, and the masks made once."""
        run, prewarm = self.run, self.prewarm
        if prewarm:
            prewarm.wait(PREWARM_TIMEOUT_S)
            run.prewarm, self.prewarm = prewarm, None
            who = f"{len(prewarm.procs)} tuning process(es)" if prewarm.procs else "kernels tuned on a thread:"
            run.log.info(f"{who} done {prewarm.seconds:.1f}s after their start, {run.load_s:.1f}s of it loading "
                         f"the model" + "".join(f"; failed: {f}" for f in prewarm.failures))
            if not prewarm.failures:
                mark_tuned(run.tuned)
            run.progress.mark("kernels_tuned")
        if capture.device.type == "cuda":  # kernels that autotune per batch size: tuned before the first batch
            started = time.monotonic()
            # the thread ran every size on the same kernels in this process: nothing is left to tune or compile
            beside = isinstance(prewarm, WarmThread) and not prewarm.failures
            sizes = capture.warm_up(self.opts.token_budget, run=not beside)
            torch.cuda.synchronize()
            run.warm_s = time.monotonic() - started
            mark_tuned(run.tuned)
            run.progress.mark("kernels_warmed")
            if sizes:
                run.log.info(f"kernels warmed for {len(sizes)} batch sizes (1..{sizes[-1]}) "
                             + ("on the thread beside the load" if beside else f"in {run.warm_s:.1f}s"))
        if capture.settle_masks():  # after the warm-up: its test forward compiles nothing
            run.log.info("attention masks made once: no host sync per batch")


def load_tokenizer(model_dir: Path):
    """The model directory's own tokenizer (never the hub); UsageError when it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {str(model_dir)!r}: cannot load its tokenizer ({exc})") from None
    if len(tokenizer) < 2:  # transformers makes an empty tokenizer from the config alone: every sample would skip
        raise UsageError(f"--model {str(model_dir)!r}: cannot load its tokenizer (no tokenizer files there: "
                         f"transformers made one of {len(tokenizer)} token(s) from the config alone); put the "
                         f"model's tokenizer.json / tokenizer_config.json beside its config.json")
    return tokenizer


#: the kernel-tuning children get this long from their start; the worker's own warm-up does what they left
PREWARM_TIMEOUT_S = 900.0


def run_shard(opts: WorkerOptions, heartbeat: Heartbeat | None = None, capture=None,
              read_ahead: ReadAhead | None = None) -> int:
    """The body of `hsextract extract` after the STARTED line: returns the process exit code.

    `heartbeat`, when given, is already beating (the CLI starts it before torch is imported). `capture` makes
    the object that loads the model and runs the forward pass (`LayerCapture`'s signature and `run`; None:
    `LayerCapture` itself). `read_ahead`, when given, is reading the checkpoint (`readahead.start_read_ahead`);
    it is stopped once the model is loaded, or when the worker ends without loading it."""
    try:
        return drive(lambda o, progress: ShardRun(o, progress, capture or LayerCapture, read_ahead), opts,
                     heartbeat)
    finally:
        if read_ahead is not None:
            read_ahead.stop()
