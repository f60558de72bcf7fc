"""One shard's bookkeeping, whatever makes its states: the lock, the journal, resume, skips, files, uploads,
the summary and the exit. No torch here: `extract.ShardRun` adds the model, `synthetic.SyntheticRun` makes
random states of the real size at a set rate (fleet simulations, the preflight) through the same path.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from hsextract import __version__
from hsextract.data.assign import shard_of
from hsextract.data.model import read_model_info
from hsextract.data.records import Bad, Record, iter_records
from hsextract.errors import BUSY_EXIT, USAGE_EXIT, CorruptOutput, Interrupted, ShardBusy, ShardIncomplete, UsageError
from hsextract.options import WorkerOptions
from hsextract.output.journal import JOURNAL_NAME, Journal, lost_files, read_entries, scan
from hsextract.output.payload import Prepared, Unsealed, write_unsealed
from hsextract.output.recipe import Recipe, refuse
from hsextract.run.layers import parse_layer_spec
from hsextract.run.liveness import Heartbeat, Progress, stop_request, write_json_atomic
from hsextract.run.status import ProgressReporter
from hsextract.say import shard_log
from hsextract.store import LocalStore, S3Store, s3_client, sha256_file

if TYPE_CHECKING:
    from hsextract.output.upload import BackgroundUploader


class Shard:
    """One shard's run to completion; a subclass's `run()` returns the summary or raises (the journal stays
    valid). It calls `begin()` first, writes its files through `write_file` / `seal_file` (or `record_file`),
    and ends with `finish()`."""

    def __init__(self, opts: WorkerOptions, progress: Progress):
        self.opts = opts
        self.progress = progress
        self.log = shard_log(opts.shard, opts.num_shards)  # what it says on stderr
        self.skips: Counter[str] = Counter()
        self.stop_signal: str | None = None
        self._journal: Journal | None = None  # opened by `begin()`
        self.started = time.time()
        self.counting = threading.Lock()  # progress is updated by the main and the writer thread
        self.recording = threading.Lock()  # file entries come from the writer and the uploader threads
        self.uploader: BackgroundUploader | None = None  # when the output is s3://
        self.extract_ended: float | None = None
        self.drain_s = 0.0  # waiting for the uploader after the last batch
        self.pipeline: dict = {}  # the extraction loop's timings
        self.assigned: set[str] = set()
        self.next_seq = 1
        self.recipe: Recipe | None = None  # what this run's states are made with: set by `run()` before `begin()`
        self.recorded_recipe: dict | None = None  # this shard's last journaled `recipe` entry (`check_recipe`)
        self.recipe_journaled = False  # this run's recipe is in the journal (before its first file entry)

    @property
    def journal(self) -> Journal:
        """The shard's journal (opened by `begin()`: nothing is recorded before it)."""
        assert self._journal is not None, "the shard's journal is read or written before begin()"
        return self._journal

    # -- set-up ---------------------------------------------------------------------------------------

    def validate(self) -> list[int]:
        """Check the options, the model's config and the layers asked for, and make the shard's dirs: the layer ids."""
        self.opts.check_inputs()
        info = read_model_info(self.opts.model)
        layer_ids = parse_layer_spec(self.opts.layers, info.num_layers)
        self.opts.prepare_dirs()
        return layer_ids

    def lock(self) -> None:
        """Take the shard dir's lock (a second writer of the shard is refused, naming the holder's pid), unless
        this process took it already (`take_lock`, before its heartbeat started)."""
        self._lock_fd = take_lock(self.opts)

    def clean_shard_dir(self) -> None:
        """Drop temp files and batch files the journal does not name (a kill between rename and journal)."""
        journaled = {e["file"] for e in read_entries(self.opts.shard_dir / JOURNAL_NAME) if e.get("kind") == "file"}
        for path in self.opts.shard_dir.iterdir():
            half_written = path.name.endswith(".tmp") and (
                path.name.startswith(".batch-") or not path.name.endswith(f".{os.getpid()}.tmp"))
            if half_written or (path.suffix == ".safetensors" and path.name not in journaled):
                path.unlink(missing_ok=True)  # never the heartbeat's own temp file: it shares this dir
        self.next_seq = 1 + max((int(name[6:12]) for name in journaled), default=0)

    def begin(self) -> list[Record | Bad]:
        """Lock the shard, start the uploads (s3://), drop what the journal does not name, open the journal,
        resume waiting uploads: this shard's records still to do."""
        opts = self.opts
        self.lock()
        if opts.upload:
            self.start_uploader()
        self.recorded_recipe = self.check_recipe()  # before a byte of this run is written
        self.clean_shard_dir()
        self._journal = Journal(opts.shard_dir)
        if self.uploader:
            self.resume_uploads()
        self.progress.phase = "reading_data"
        return self.pending_records()

    def run(self, layer_ids: list[int]) -> dict:
        raise NotImplementedError

    def check_recipe(self) -> dict | None:
        """RecipeMismatch (exit 2) when this shard's journal, or any other shard's in the output (in the store,
        for s3://: the journals the uploader fetched), records another recipe than this run's; returns this
        shard's last recorded `recipe` entry (None: none yet)."""
        if self.recipe is None:
            return None
        state = scan(LocalStore(self.opts.out_dir))
        mine = self.opts.shard_dir.name
        where = self.opts.upload or str(self.opts.out_dir)  # (the message stays short: the reason line of a run)
        for shard_dir in sorted(state.recipes, key=lambda d: d != mine):  # this shard's own journal first
            entry = state.recipes[shard_dir]
            recorded = Recipe.from_json(entry.get("recipe") or {}, f"{where}/{shard_dir}/{JOURNAL_NAME}")
            refuse(self.recipe, recorded, "this shard" if shard_dir == mine else "the output")
        return state.recipes.get(mine)

    def recipe_metadata(self) -> dict[str, str]:
        """The batch files' metadata naming this run's recipe (its fingerprint, and the recipe as JSON)."""
        if self.recipe is None:
            return {}
        return {"recipe_fingerprint": self.recipe.fingerprint,
                "recipe": json.dumps(self.recipe.to_json(), separators=(",", ":"))}

    def record_recipe(self) -> None:
        """Before this run's first file entry: journal its recipe where the shard has none yet, or where this
        run's versions differ from the last run's (the fingerprint is the same: `check_recipe` refused any
        other). A run that stores nothing records no recipe: a corrected retry is not held to it."""
        if self.recipe is None or self.recipe_journaled:
            return
        self.recipe_journaled = True
        mine, recorded = self.recipe.to_json(), self.recorded_recipe
        if recorded is None or (recorded.get("recipe") or {}).get("versions") != mine["versions"]:
            self.journal.append({"kind": "recipe", "fingerprint": self.recipe.fingerprint, "recipe": mine},
                                durable=True)

    def start_uploader(self) -> None:
        """With an s3:// output: take the store's journals into the spool, and start the uploader."""
        from hsextract.output.upload import BackgroundUploader, Spool, fetch_journals, spool_marks

        opts = self.opts
        assert opts.upload is not None  # `begin()` starts the uploader only for an s3:// output
        store = S3Store(opts.upload, s3_client(opts.s3_endpoint))
        fetch_journals(store, opts.out_dir)  # what every earlier run put in the store counts as done
        # parts of uploads an earlier worker of this shard never finished (killed, stopped mid-file): this one
        # holds the shard's lock, so none of them is still going on
        aborted: list[str]
        try:
            aborted = store.abort_uploads(f"{opts.shard_dir.name}/")
        except Exception as exc:  # noqa: BLE001 - a cleanup: no ListBucketMultipartUploads right must not stop it
            aborted = []
            self.log.warning(f"warning: cannot list or abort unfinished multipart uploads under "
                             f"{store.where(opts.shard_dir.name + '/')} ({type(exc).__name__}: {exc}); parts an "
                             f"earlier worker left stay until the bucket's lifecycle rule removes them")
        if aborted:
            self.log.info(f"aborted {len(aborted)} unfinished multipart upload(s) an earlier worker left: "
                          f"{', '.join(aborted[:5])}")
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
        assert self.uploader is not None  # `begin()` calls this only with one
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
            self.log.warning(why)

    def pending_records(self) -> list[Record | Bad]:
        """This shard's records not yet written or skipped by any run; records duplicates as skipped."""
        state = scan(LocalStore(self.opts.out_dir))
        seen: set[str] = set()
        pending: list[Record | Bad] = []
        changed: list[str] = []
        mine = self.opts.shard
        for item in iter_records(self.opts.data, keep=lambda i: shard_of(i, self.opts.num_shards) == mine):
            if item.id in seen:
                if (item.id, item.line) not in state.duplicates:
                    self.skip(item.id, "duplicate_id", "the same id appears earlier in the file", item.line)
                continue
            seen.add(item.id)
            made_from = state.sources.get(item.id)
            if made_from and isinstance(item, Record) and item.digest != made_from:
                changed.append(f"{item.id} (line {item.line})")
            if state.finished(item.id) and state.skipped.get(item.id) not in self.opts.retry_reasons:
                self.progress.samples_done += 1
            else:
                pending.append(item)
        if changed:
            raise UsageError(f"shard {self.opts.shard}/{self.opts.num_shards}: {len(changed)} record(s) of --data are "
                             f"not the records their stored samples were made from, e.g. {', '.join(changed[:3])}: "
                             f"the dataset changed, or another one reuses its ids. A changed dataset takes a new "
                             f"output")
        self.assigned = seen
        self.progress.samples_total = len(seen)
        return pending

    def skip(self, sample_id: str, reason: str, detail: str, line: int | None = None, counts_as_done=False) -> None:
        """Journal `sample_id` as skipped with `reason` and count it."""
        self.journal.append({"kind": "skip", "id": sample_id, "reason": reason, "detail": detail, "line": line})
        with self.counting:  # skips come from the main thread (oom, tokenizing) and the prepare thread (NaN)
            self.skips[reason] += 1
            self.progress.samples_skipped += 1
            self.progress.samples_done += int(counts_as_done)

    def write_file(self, prep: Prepared) -> Unsealed | None:
        """Copy a prepared file into the page cache under its temp name (the disk catches up in `seal_file`);
        or, with --upload-from memory and room in its budget, hand its bytes to the uploader (None)."""
        if self.uploader and self.uploader.reserve_memory(prep.payload.size):
            assert prep.payload.sha256 is not None  # the writer hashes every file before it writes it
            entry = self.file_entry(prep, prep.payload.size, prep.payload.sha256, prep.payload.xxh3) | {
                "from_memory": True, **({"rms": prep.rms} if prep.rms is not None else {})}
            self.uploader.submit_memory(entry, prep.payload.tobytes(), self.record_file)
            return None
        if self.uploader:  # bounded local disk: over the high-water mark, wait for uploads to catch up
            self.uploader.spool.reserve(prep.payload.size, self.uploader.failed)
            self.uploader.raise_if_failed()
        return write_unsealed(self.opts.shard_dir / prep.name, prep.payload)

    def seal_file(self, prep: Prepared, unsealed: Unsealed) -> None:
        """Make a written file durable and put it in place, then journal it (the journal names only files
        that are durable) and queue its upload."""
        written = unsealed.seal()
        entry = self.file_entry(prep, written.bytes, written.sha256, written.xxh3)
        if prep.rms is not None:
            entry["rms"] = prep.rms
        self.record_file(entry)
        self.progress.mark("first_file")
        if self.uploader:
            self.uploader.submit(entry, reserved=True)

    @staticmethod
    def file_entry(prep: Prepared, size: int, sha256: str, xxh3: str | None = None) -> dict:
        """The journal entry of a written (or stored) file (with its samples' provenance, where known)."""
        return {"kind": "file", "file": prep.name, "ids": prep.ids, "tokens": sum(prep.lengths),
                "lengths": prep.lengths, "bytes": size, "sha256": sha256, **({"xxh3": xxh3} if xxh3 else {}),
                **(getattr(prep, "provenance", None) or {})}

    def record_file(self, entry: dict) -> None:
        """Journal a file that is durable (on disk, or verified in the store) and count it."""
        with self.recording:
            self.record_recipe()
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
        self.check_skipped(state)
        summary = self.summary()
        self.journal.append({"kind": "done", "summary": summary}, durable=True)
        write_json_atomic(self.opts.shard_dir / "summary.json", summary)
        if self.uploader:
            self.uploader.mirror_journal()
        return summary

    def check_skipped(self, state) -> None:
        """UsageError (exit 2) when this shard stored none of its samples, or skipped more than --max-skipped of
        them (every run's skips counted): the data or the options are wrong, and a run that stores nothing is
        no success. Names the top reasons with a count and an example line each."""
        assigned = self.assigned
        skipped = {i: state.skipped[i] for i in assigned if i in state.skipped and i not in state.written}
        if not assigned or (len(skipped) <= self.opts.max_skipped * len(assigned) and len(skipped) < len(assigned)):
            return
        examples: dict[str, dict] = {}
        for entry in read_entries(self.opts.shard_dir / JOURNAL_NAME):
            if entry.get("kind") == "skip" and entry.get("id") in skipped:
                examples.setdefault(entry["reason"], entry)
        counts = Counter(skipped.values()).most_common(3)
        def example(reason: str) -> str:
            entry = examples.get(reason, {})
            where = f"line {entry['line']}" if entry.get("line") is not None else f"sample {entry.get('id', '?')}"
            return f"e.g. {where}: {str(entry.get('detail', ''))[:80]}"

        reasons = "; ".join(f"{reason} x{n} ({example(reason)})" for reason, n in counts)
        what = (f"stored none of its {len(assigned)} sample(s)" if len(skipped) == len(assigned) else
                f"skipped {len(skipped)} of its {len(assigned)} sample(s) ({len(skipped) / len(assigned):.1%}, over "
                f"--max-skipped {self.opts.max_skipped:g})")
        raise UsageError(f"shard {self.opts.shard}/{self.opts.num_shards} {what}: {reasons}. Fix the data or the "
                         f"options, then run again with --retry-skipped {','.join(r for r, _ in counts)} (the "
                         f"flow's retry_skipped)")

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
            **self.summary_extra(),
            "startup": p.startup,
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

    def summary_extra(self) -> dict:
        """What a kind of run adds to the summary, after `padding_waste` (the model's load, the GPU's memory)."""
        return {}


_HELD: dict[str, int] = {}  # shard dir -> the lock's fd, taken by this process


def take_lock(opts: WorkerOptions) -> int:
    """The shard dir's lock for this process (flock on `.lock`, holding the pid): ShardBusy naming the holder when
    another live process has it. The CLI takes it before the heartbeat starts, so a second worker of a shard
    leaves the first one's heartbeat and exit record alone; taken once per process."""
    key = str(opts.shard_dir)
    if key in _HELD:
        return _HELD[key]
    opts.shard_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(opts.shard_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ShardBusy(f"shard {opts.shard}/{opts.num_shards}: {opts.shard_dir} is already being written by pid "
                        f"{holder}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[key] = fd
    return fd


#: on a stop, how long a worker lets its uploads in flight finish (at most half the stop request's grace)
UPLOAD_STOP_WAIT_S = 5.0


def install_signal_handlers(shard: Shard) -> None:
    """SIGTERM/SIGINT: during extraction stop after the file in flight; before it, stop at once."""

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        shard.stop_signal = name
        if shard.progress.phase != "extracting":
            raise Interrupted(name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def drive(make_shard, opts: WorkerOptions, heartbeat: Heartbeat | None = None) -> int:
    """The body of `hsextract extract` after the STARTED line, for a kind of run (`make_shard(opts, progress)`
    makes its `Shard`): returns the process exit code, and leaves the exit record whatever happens.

    `heartbeat`, when given, is already beating (the CLI starts it before anything heavy is imported)."""
    progress = heartbeat.progress if heartbeat else Progress(opts.shard, opts.num_shards, __version__)
    shard = make_shard(opts, progress)
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
    except (UsageError, CorruptOutput) as exc:  # neither is mended by running again
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
        if shard._journal is not None:
            shard._journal.close()
        heartbeat.finish(code, reason, **stop)
    if code != 0:
        shard_log(opts.shard, opts.num_shards).error(f"failed: {reason}")
    return code
