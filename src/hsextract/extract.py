"""One shard's extraction: assigned samples -> packed batches -> captured states -> journaled files."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

from . import __version__
from .batchfile import build_payload
from .batching import batch_size_buckets, pack, padded_tokens
from .capture import LayerCapture, resolve_device, resolve_dtype
from .chat import ChatEncoder, Rejected, Tokenized
from .errors import BUSY_EXIT, USAGE_EXIT, Interrupted, ShardBusy, ShardIncomplete, UsageError
from .journal import JOURNAL_NAME, Journal, lost_files, read_entries
from .layers import parse_layer_spec
from .liveness import Heartbeat, Progress, stop_request, write_json_atomic
from .options import WorkerOptions
from .payload import Unsealed, write_unsealed
from .preflight import read_model_info
from .prewarm import SHORTEST, Prewarm, default_procs, mark_tuned, tuned_marker
from .records import Bad, Record, iter_records
from .sharding import shard_of
from .quant import FP8_ENCODING, SCALE_KEY, fp8_bytes_per_token, quantize
from .status import ProgressReporter
from .store import LocalStore, S3Store, s3_client, scan, sha256_file
from .writer import BAD_KEY, BatchWriter, Prepared


class ShardRun:
    """Runs one shard to completion; `run()` returns the summary or raises (the journal stays valid)."""

    def __init__(self, opts: WorkerOptions, progress: Progress, capture=LayerCapture):
        self.opts = opts
        self.make_capture = capture  # the model's forward: a seam where tests inject faults (harness.faulty)
        self.progress = progress
        self.skips: Counter[str] = Counter()
        self.stop_signal: str | None = None
        self.journal: Journal | None = None
        self.started = time.time()
        self.counting = threading.Lock()  # progress is updated by the main and the writer thread
        self.uploader = None  # BackgroundUploader when the output is s3://
        self.extract_ended: float | None = None
        self.drain_s = 0.0  # waiting for the uploader after the last batch
        self.load_s: float | None = None  # making the model (read or built) and putting it on the device
        self.warm_s: float | None = None  # tuning the kernels for every batch size before the first batch (CUDA)
        self.prewarm: Prewarm | None = None  # the child processes that tuned them while the model loaded
        self.tuned: Path | None = None  # the file that says this host has tuned them (prewarm.tuned_marker)
        self.tuned_before = False  # it was there at the start: no tuning processes
        self.pipeline: dict = {}  # BatchWriter.timings() of the extraction loop
        self.loop = ForwardLoopTimer(torch.device("cpu"))  # the forward loop's own timings (run() makes one)

    # -- set-up ---------------------------------------------------------------------------------------
    def validate(self) -> list[int]:
        """Check the options, the model's config and the layers asked for, and make the shard's dirs: the layer ids."""
        self.opts.check_inputs()
        info = read_model_info(self.opts.model)
        layer_ids = parse_layer_spec(self.opts.layers, info.num_layers)
        self.opts.prepare_dirs()
        return layer_ids

    def lock(self) -> None:
        """Take the shard dir's lock (a second writer of the shard is refused, naming the holder's pid)."""
        self._lock_fd = os.open(self.opts.shard_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 64, 0).decode(errors="replace").strip() or "another process"
            raise ShardBusy(f"shard {self.opts.shard}/{self.opts.num_shards}: {self.opts.shard_dir} is "
                             f"already being written by pid {holder}") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, str(os.getpid()).encode(), 0)

    def clean_shard_dir(self) -> None:
        """Drop temp files and batch files the journal does not name (a kill between rename and journal)."""
        journaled = {e["file"] for e in read_entries(self.opts.shard_dir / JOURNAL_NAME) if e.get("kind") == "file"}
        for path in self.opts.shard_dir.iterdir():
            half_written = path.name.endswith(".tmp") and (
                path.name.startswith(".batch-") or not path.name.endswith(f".{os.getpid()}.tmp"))
            if half_written or (path.suffix == ".safetensors" and path.name not in journaled):
                path.unlink(missing_ok=True)  # never the heartbeat's own temp file: it shares this dir
        self.next_seq = 1 + max((int(name[6:12]) for name in journaled), default=0)

    # -- the run --------------------------------------------------------------------------------------
    def run(self, layer_ids: list[int]) -> dict:
        """Resume, extract every pending sample of the shard, drain the uploads: the summary (journaled `done`)."""
        opts = self.opts
        self.lock()
        if opts.upload:
            self.start_uploader()
        self.clean_shard_dir()
        self.journal = Journal(opts.shard_dir)
        if self.uploader:
            self.resume_uploads()
        self.progress.phase = "reading_data"
        pending = self.pending_records()
        if not pending:
            return self.finish()  # everything assigned is already written or skipped: no model needed
        self.progress.phase = "loading_model"
        device = resolve_device(opts.device)
        if opts.random_weights is not None:
            print(f"hsextract: shard {opts.shard}/{opts.num_shards}: warning: --random-weights {opts.random_weights}: "
                  f"the weights of {opts.model} are not loaded; the states are of a random model", file=sys.stderr,
                  flush=True)
        dtype = resolve_dtype(opts.dtype, device)
        prewarm = self.start_prewarm(device, dtype)
        started = time.monotonic()
        try:
            capture = self.make_capture(opts.model, layer_ids, opts.include_last, device, dtype,
                                        random_weights=opts.random_weights)
        except BaseException:
            if prewarm:
                prewarm.kill()
            raise
        self.load_s = time.monotonic() - started
        how = ", ".join(x for x in (getattr(capture, "load_path", ""), *getattr(capture, "kernels", ())) if x)
        print(f"hsextract: shard {opts.shard}/{opts.num_shards}: model loaded in {self.load_s:.1f}s on {device}"
              + (f" ({how})" if how else ""), file=sys.stderr, flush=True)
        if prewarm:
            self.prewarm = prewarm
            prewarm.wait(PREWARM_TIMEOUT_S)
            print(f"hsextract: shard {opts.shard}/{opts.num_shards}: {len(prewarm.procs)} tuning process(es) done "
                  f"{prewarm.seconds:.1f}s after their start, {self.load_s:.1f}s of it loading the model"
                  + "".join(f"; failed: {f}" for f in prewarm.failures), file=sys.stderr, flush=True)
            if not prewarm.failures:
                mark_tuned(self.tuned)
        if capture.device.type == "cuda":  # kernels that autotune per batch size: tuned before the first batch
            started = time.monotonic()
            sizes = capture.warm_up(opts.token_budget)
            torch.cuda.synchronize()
            self.warm_s = time.monotonic() - started
            mark_tuned(self.tuned)
            if sizes:
                print(f"hsextract: shard {opts.shard}/{opts.num_shards}: kernels warmed for {len(sizes)} batch sizes "
                      f"(1..{sizes[-1]}) in {self.warm_s:.1f}s", file=sys.stderr, flush=True)
        encoder = ChatEncoder(load_tokenizer(opts.model), capture.info.vocab_size, opts.max_length, opts.overlong)
        self.metadata = {
            "sample_ids": "", "layer_ids": json.dumps(layer_ids), "model": opts.model.name,
            "hidden_size": str(capture.hidden_size), "num_model_layers": str(capture.info.num_layers),
            "dtype": str(capture.dtype).removeprefix("torch."), "hsextract_version": __version__,
            **({"hidden_states_encoding": FP8_ENCODING} if opts.out_dtype == "fp8_e4m3" else {}),
            **({"random_weights": str(opts.random_weights)} if opts.random_weights is not None else {}),
        }
        self.progress.phase = "extracting"
        self.progress.extract_started_at = time.time()
        writer = BatchWriter(self, capture.device, hash_workers=opts.hash_threads or None,
                             bytes_per_token=self.bytes_per_token(capture), token_budget=opts.token_budget)
        self.loop = ForwardLoopTimer(capture.device)
        batches = pack(self.encoded(encoder, pending), opts.token_budget, opts.sort_window)
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
        if self.stop_signal:
            raise Interrupted(self.stop_signal)
        return self.finish()

    def bytes_per_token(self, capture: LayerCapture) -> int:
        """Host bytes a token's states take on their way to a file (what a pinned set is sized from)."""
        element = torch.empty(0, dtype=capture.dtype).element_size()
        if self.opts.out_dtype == "fp8_e4m3":
            per = fp8_bytes_per_token(capture.width, len(capture.layer_ids))
        else:
            per = capture.width * element
        if capture.include_last:
            per += capture.hidden_size * element
        return per + 1  # the non-finite flags: one per sample, at most one per token

    def start_prewarm(self, device: str, dtype: torch.dtype) -> Prewarm | None:
        """On CUDA with fla (or wherever --tune-procs N asks for them), child processes that tune the kernels
        for every batch size while the model loads (`hsextract.prewarm`); None when there are none, or when
        this host tuned the same sizes for the same shapes, GPU and software before (`tuned_marker`)."""
        opts, procs = self.opts, self.opts.tune_procs
        if procs is None:
            auto = device.startswith("cuda") and importlib.util.find_spec("fla") is not None
            procs = default_procs() if auto else 0
        if procs == 0:
            return None
        sizes = batch_size_buckets(max(1, opts.token_budget // SHORTEST))
        self.tuned = tuned_marker(opts.model, sizes, device, dtype)
        if self.tuned is not None and self.tuned.exists():
            print(f"hsextract: shard {opts.shard}/{opts.num_shards}: kernels tuned on this host before "
                  f"({self.tuned}): no tuning processes", file=sys.stderr, flush=True)
            self.tuned_before = True
            return None
        return Prewarm.start(opts.model, sizes, opts.token_budget, device, dtype, procs)

    def start_uploader(self) -> None:
        """With an s3:// output: take the store's journals into the spool, and start the uploader."""
        from .upload import BackgroundUploader, Spool, fetch_journals, spool_marks

        opts = self.opts
        store = S3Store(opts.upload, s3_client(opts.s3_endpoint))
        fetch_journals(store, opts.out_dir)  # what every earlier run put in the store counts as done
        # parts of uploads an earlier worker of this shard never finished (killed, stopped mid-file): this one
        # holds the shard's lock, so none of them is still going on
        try:
            aborted = store.abort_uploads(f"{opts.shard_dir.name}/")
        except Exception as exc:  # noqa: BLE001 - a cleanup: no ListBucketMultipartUploads right must not stop it
            aborted = []
            print(f"hsextract: shard {opts.shard}/{opts.num_shards}: warning: cannot list or abort unfinished "
                  f"multipart uploads under {store.where(opts.shard_dir.name + '/')} ({type(exc).__name__}: {exc}); "
                  f"parts an earlier worker left stay until the bucket's lifecycle rule removes them",
                  file=sys.stderr, flush=True)
        if aborted:
            print(f"hsextract: shard {opts.shard}/{opts.num_shards}: aborted {len(aborted)} unfinished multipart "
                  f"upload(s) an earlier worker left: {', '.join(aborted[:5])}", file=sys.stderr, flush=True)
        high, low = spool_marks(opts.out_dir, opts.spool_high_bytes, opts.spool_low_bytes,
                                f"shard {opts.shard}/{opts.num_shards}")
        spool = Spool(high, low, self.progress)
        self.uploader = BackgroundUploader(store, opts.shard_dir, spool, opts.upload_part_bytes,
                                           memory_bytes=opts.upload_memory_bytes if opts.upload_from == "memory" else 0)

    def resume_uploads(self) -> None:
        """Journaled files still on local disk were not verified in the store yet: send them first.
        Journaled files that are gone were deleted after their verification: they are in the store.
        A waiting file that no longer matches its journal entry (the disk or someone altered it) can never
        be uploaded: it is journaled `lost` and deleted, so this run extracts its samples again."""
        entries = list(read_entries(self.opts.shard_dir / JOURNAL_NAME))
        lost = lost_files(entries)
        for entry in entries:
            if entry.get("kind") != "file" or entry["file"] in lost:
                continue
            path = self.opts.shard_dir / entry["file"]
            if not path.exists():
                self.uploader.uploaded.add(entry["file"])
                continue
            size, digest = path.stat().st_size, sha256_file(path)
            if (size, digest) == (entry["bytes"], entry["sha256"]):
                self.uploader.submit(entry)
                continue
            why = (f"waiting for upload, {path} holds sha256 {digest} / {size} bytes, but the journal wrote "
                   f"{entry['sha256']} / {entry['bytes']}: deleted, its {len(entry['ids'])} sample(s) redone")
            self.journal.append({"kind": "lost", "file": entry["file"], "why": why}, durable=True)
            path.unlink()
            print(f"hsextract: shard {self.opts.shard}/{self.opts.num_shards}: {why}", file=sys.stderr, flush=True)

    def pending_records(self) -> list[Record | Bad]:
        """This shard's records not yet written or skipped by any run; records duplicates as skipped."""
        state = scan(LocalStore(self.opts.out_dir))
        seen: set[str] = set()
        pending: list[Record | Bad] = []
        for item in iter_records(self.opts.data):
            if shard_of(item.id, self.opts.num_shards) != self.opts.shard:
                continue
            if item.id in seen:
                if (item.id, item.line) not in state.duplicates:
                    self.skip(item.id, "duplicate_id", "the same id appears earlier in the file", item.line)
                continue
            seen.add(item.id)
            if state.finished(item.id) and state.skipped.get(item.id) not in self.opts.retry_reasons:
                self.progress.samples_done += 1
            else:
                pending.append(item)
        self.assigned = seen
        self.progress.samples_total = len(seen)
        return pending

    def encoded(self, encoder: ChatEncoder, pending: list[Record | Bad]) -> Iterator[Tokenized]:
        """Tokenize the pending records; the ones that cannot train are journaled as skipped on the way."""
        for item in pending:
            result = Rejected(item.id, item.reason, item.detail) if isinstance(item, Bad) else encoder.encode(item)
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
                    states[BAD_KEY] = self.nonfinite_flags(part, states)
                    if self.opts.out_dtype == "fp8_e4m3":  # after the NaN check, which needs the real values
                        states["hidden_states"], states[SCALE_KEY] = quantize(states["hidden_states"],
                                                                              capture.hidden_size)
                oom = None
            except torch.OutOfMemoryError as exc:
                oom, states = str(exc), None
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
            self.progress.padded_tokens += padded_tokens(part)
            self.progress.tokens_forwarded += sum(len(s) for s in part)
            yield part, states
            states = None

    @staticmethod
    def nonfinite_flags(batch: list[Tokenized], states: dict) -> torch.Tensor:
        """[B] bool on the states' device: which samples have a NaN or Inf anywhere (no host sync)."""
        device = states["hidden_states"].device
        lengths = torch.tensor([len(s) for s in batch], pin_memory=device.type == "cuda").to(device, non_blocking=True)
        sample_of_T = torch.repeat_interleave(torch.arange(len(batch), device=device), lengths,
                                              output_size=sum(len(s) for s in batch))
        bad_B = torch.zeros(len(batch), device=device)
        for tensor in states.values():
            bad_B.index_add_(0, sample_of_T, (~torch.isfinite(tensor)).any(dim=1).float())
        return bad_B > 0

    def drop_nonfinite(self, batch: list[Tokenized], states: dict, bad: list[bool]) -> tuple[list[Tokenized], dict]:
        """Skip (with a reason) the samples flagged by `nonfinite_flags`; host tensors in, host tensors out."""
        if not any(bad):
            return batch, states
        lengths = torch.tensor([len(s) for s in batch])
        keep_T = torch.repeat_interleave(~torch.tensor(bad), lengths)
        for sample, b in zip(batch, bad):
            if b:
                self.skip(sample.id, "nonfinite_states", "NaN or Inf in captured hidden states", counts_as_done=True)
        return [s for s, b in zip(batch, bad) if not b], {k: v[keep_T] for k, v in states.items()}

    def skip(self, sample_id: str, reason: str, detail: str, line: int | None = None, counts_as_done=False) -> None:
        """Journal `sample_id` as skipped with `reason` and count it."""
        self.journal.append({"kind": "skip", "id": sample_id, "reason": reason, "detail": detail, "line": line})
        with self.counting:  # skips come from the main thread (oom, tokenizing) and the prepare thread (NaN)
            self.skips[reason] += 1
            self.progress.samples_skipped += 1
            self.progress.samples_done += int(counts_as_done)

    def prepare_file(self, batch: list[Tokenized], states: dict, hashed: bool = True) -> "Prepared":
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
        return Prepared(name, build_payload(tensors, metadata, hashed), ids, lengths)

    def write_file(self, prep: "Prepared") -> Unsealed | None:
        """Copy a prepared file into the page cache under its temp name (the disk catches up in `seal_file`);
        or, with --upload-from memory and room in its budget, hand its bytes to the uploader (None)."""
        if self.uploader and self.uploader.reserve_memory(prep.payload.size):
            entry = self.file_entry(prep, prep.payload.size, prep.payload.sha256) | {"from_memory": True}
            self.uploader.submit_memory(entry, prep.payload.tobytes(), self.record_file)
            return None
        if self.uploader:  # bounded local disk: over the high-water mark, wait for uploads to catch up
            self.uploader.spool.reserve(prep.payload.size, self.uploader.failed)
            self.uploader.raise_if_failed()
        return write_unsealed(self.opts.shard_dir / prep.name, prep.payload)

    def seal_file(self, prep: "Prepared", unsealed: Unsealed) -> None:
        """Make a written file durable and put it in place, then journal it (the journal names only files
        that are durable) and queue its upload."""
        written = unsealed.seal()
        entry = self.file_entry(prep, written.bytes, written.sha256)
        self.record_file(entry)
        if self.uploader:
            self.uploader.submit(entry, reserved=True)

    @staticmethod
    def file_entry(prep: "Prepared", size: int, sha256: str) -> dict:
        """The journal entry of a written (or stored) file."""
        return {"kind": "file", "file": prep.name, "ids": prep.ids, "tokens": sum(prep.lengths),
                "lengths": prep.lengths, "bytes": size, "sha256": sha256}

    def record_file(self, entry: dict) -> None:
        """Journal a file that is durable (on disk, or verified in the store) and count it."""
        self.journal.append(entry, durable=True)
        p = self.progress
        with self.counting:
            p.samples_done += len(entry["ids"])
            p.samples_written += len(entry["ids"])
            p.tokens_done += entry["tokens"]
            p.files += 1
            p.bytes += entry["bytes"]
            p.last_batch = entry["file"]

    def finish(self) -> dict:
        """Drain the uploads, prove every assigned sample is written or skipped, journal `done`: the summary."""
        if self.uploader:
            self.progress.phase = "uploading"
            started = time.monotonic()
            self.uploader.drain()  # every file verified in the store, or the upload error
            self.drain_s = time.monotonic() - started
        state = scan(LocalStore(self.opts.out_dir))
        missing = [i for i in self.assigned if not state.finished(i)]
        if missing:
            raise ShardIncomplete(f"shard {self.opts.shard}/{self.opts.num_shards}: {len(missing)} sample(s) "
                                  f"neither written nor skipped, e.g. {sorted(missing)[:5]}")
        summary = self.summary()
        self.journal.append({"kind": "done", "summary": summary}, durable=True)
        write_json_atomic(self.opts.shard_dir / "summary.json", summary)
        if self.uploader:
            self.uploader.mirror_journal()
        return summary

    def summary(self) -> dict:
        """What the shard did: samples, skips by reason, tokens, files, bytes, speeds, the pipeline's timings."""
        p = self.progress
        seconds = time.time() - self.started
        ended = self.extract_ended or time.time()
        extract_s = ended - (p.extract_started_at or ended)  # the forward loop and its writes, not the drain
        return {
            "shard": p.shard, "num_shards": p.num_shards, "samples_total": p.samples_total,
            "samples_done": p.samples_done, "samples_written": p.samples_written,
            "skipped": dict(self.skips), "tokens": p.tokens_done, "files": p.files, "bytes": p.bytes,
            "forward_passes": p.forward_passes, "seconds": round(seconds, 3), "confined": p.confined,
            "padded_tokens": p.padded_tokens,
            "padding_waste": round(p.padded_tokens / p.tokens_forwarded - 1, 4) if p.tokens_forwarded else 0.0,
            **({"peak_gpu_bytes": torch.cuda.max_memory_allocated()} if torch.cuda.is_initialized() else {}),
            **({"load_s": round(self.load_s, 3)} if self.load_s is not None else {}),
            **({"warm_s": round(self.warm_s, 3)} if self.warm_s is not None else {}),
            **({"tune": {"procs": len(self.prewarm.procs), "seconds": round(self.prewarm.seconds, 3),
                         "failed": len(self.prewarm.failures)}} if self.prewarm else
               {"tune": {"procs": 0, "tuned_before": True}} if self.tuned_before else {}),
            "extract_s": round(extract_s, 3),
            "tokens_per_s": round(p.tokens_done / extract_s, 1) if extract_s > 0 else 0.0,
            **({"upload": {"files": self.uploader.files_uploaded, "bytes": self.uploader.bytes_uploaded,
                           "drain_s": round(self.drain_s, 3),
                           "paused_s": round(self.uploader.spool.paused_s, 3),
                           "max_spool_bytes": self.uploader.spool.max_pending,
                           "from_memory": self.uploader.files_from_memory,
                           "max_memory_bytes": self.uploader.max_in_memory}} if self.uploader else {}),
            **({"pipeline": self.pipeline} if self.pipeline else {}),
        }


class ForwardLoopTimer:
    """Where the forward loop's time goes: `next_batch_s` waiting for the next batch (reading, tokenizing,
    packing), `forward_s` queuing forwards on the host; on CUDA also the device's side, from an event pair
    around each forward (never waited for: pairs are read once done, the rest at the end):
    `gpu_forward_s` the device spent in forwards, `gpu_idle_s` it had none to run between the first and the
    last (the host did not keep it fed)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spent: Counter = Counter()
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


def load_tokenizer(model_dir: Path):
    """The model directory's own tokenizer (never the hub); UsageError when it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {str(model_dir)!r}: cannot load its tokenizer ({exc})") from None


#: on a stop, how long a worker lets its uploads in flight finish (at most half the stop request's grace)
UPLOAD_STOP_WAIT_S = 5.0
#: the kernel-tuning children get this long from their start; the worker's own warm-up does what they left
PREWARM_TIMEOUT_S = 900.0


def install_signal_handlers(shard: ShardRun) -> None:
    """SIGTERM/SIGINT: during extraction stop after the file in flight; before it, stop at once."""

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        shard.stop_signal = name
        if shard.progress.phase != "extracting":
            raise Interrupted(name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def run_shard(opts: WorkerOptions, heartbeat: Heartbeat | None = None, capture=None) -> int:
    """The body of `hsextract extract` after the STARTED line: returns the process exit code.

    `heartbeat`, when given, is already beating (the CLI starts it before torch is imported). `capture` makes
    the object that loads the model and runs the forward pass (`LayerCapture`'s signature and `run`; None:
    `LayerCapture` itself)."""
    progress = heartbeat.progress if heartbeat else Progress(opts.shard, opts.num_shards, __version__)
    shard = ShardRun(opts, progress, capture or LayerCapture)
    install_signal_handlers(shard)
    started = heartbeat is not None
    heartbeat = heartbeat or Heartbeat(opts.status_path, progress, opts.heartbeat_interval)
    reporter = ProgressReporter(progress, opts.progress, opts.log_interval)
    code, reason, stop = 1, "unknown", {}
    try:
        layer_ids = shard.validate()
        if not started:
            heartbeat.start()
        reporter.start()
        summary = shard.run(layer_ids)
        code, reason = 0, "complete"
        reporter.close()
        print("SUMMARY " + json.dumps(summary), flush=True)
    except UsageError as exc:
        code, reason = USAGE_EXIT, f"usage: {exc}"
    except ShardBusy as exc:
        code, reason = BUSY_EXIT, f"busy: {exc}"
    except Interrupted as exc:
        code, reason = 128 + signal.Signals[exc.signame].value, str(exc)
        request = stop_request(opts.status_path)
        if request is not None:  # the orchestrator asked: say what it was, in its words
            stop = {"stop": request["stop"]}
            reason = f"{request['stop']}: {request.get('why') or 'asked to stop'} ({exc})"
        if shard.uploader is not None:  # uploads in flight may finish, well within the grace before SIGKILL
            grace = (request or {}).get("grace_s")
            wait = min(UPLOAD_STOP_WAIT_S, float(grace) / 2) if isinstance(grace, (int, float)) else UPLOAD_STOP_WAIT_S
            try:
                left = shard.uploader.stop(wait)
                reason += f"; {shard.uploader.files_uploaded} file(s) uploaded" + (
                    f", {left} upload(s) cut short (the next run sends them again)" if left else "")
            except Exception as error:  # noqa: BLE001 - the stop stands; the next run mirrors the journal
                reason += f"; the journal's mirror in the store failed ({type(error).__name__}: {error})"
    except ShardIncomplete as exc:
        code, reason = 3, str(exc)
    except Exception as exc:
        code, reason = 1, f"{type(exc).__name__}: {exc}"
        if isinstance(exc, PermissionError) and progress.confined:
            reason += (" (this worker may write only beneath its own shard's directories, see the 'writes "
                       "confined to' line of its log; --confine off lifts that)")
        import traceback

        traceback.print_exc()
    finally:
        reporter.close()
        if shard.journal is not None:
            shard.journal.close()
        heartbeat.finish(code, reason, **stop)
    if code != 0:
        print(f"hsextract: shard {opts.shard}/{opts.num_shards} failed: {reason}", file=sys.stderr, flush=True)
    return code
