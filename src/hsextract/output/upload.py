"""Send journaled batch files to S3 and prove each landed intact before the local copy is freed.

`upload_verified` is the unit the host-side uploader runs per file:
1. read the local file once, computing its sha256 and the per-part sha256s of the multipart layout;
   a file whose sha256 differs from the journal's (written when the file was made) is corrupt on disk
   and is never uploaded (`CorruptFile`);
2. under `part_size`: one PUT carrying that verified SHA256 (the store checks the body against it); from
   `part_size` up: boto3's transfer manager (multipart, parallel parts, SHA256 checksum per part); the
   journal's sha256 goes along as object metadata; a failed multipart upload is aborted by the manager;
3. HEAD the object with checksums on and compare size and the full (or composite, for multipart) SHA256
   with what the local bytes give; only then delete the local file.
Transient S3 errors (5xx, throttling, timeouts, resets) are retried by botocore's standard mode with
backoff up to `attempts`; after that the error is raised with the S3 code and the key.
"""

from __future__ import annotations

import base64
import hashlib
import io
import queue
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hsextract.errors import HsExtractError
from hsextract.output.journal import JOURNAL_NAME, journal_keys, line, read_entries, retractions_missing
from hsextract.store import LocalStore, S3Store, Store


class CorruptFile(HsExtractError):
    """The local file does not match its journal entry: uploading it would ship bad data."""


class UploadMismatch(HsExtractError):
    """S3 holds something other than what was sent (size or checksum differ)."""


@dataclass(frozen=True)
class Uploaded:
    """An object stored and verified: its key, size, sha256, parts, and the checksum S3 reported."""
    key: str
    bytes: int
    sha256: str
    parts: int
    checksum: str   # what S3 reported (base64, '-N' suffix for multipart)


def local_digests(source: Path | bytes, part_size: int) -> tuple[str, list[bytes], int]:
    """(hex sha256 of the file or bytes, raw sha256 of each `part_size` part, size), reading it once."""
    whole, parts, size = hashlib.sha256(), [], 0
    with source.open("rb") if isinstance(source, Path) else io.BytesIO(source) as handle:
        while chunk := handle.read(part_size):
            whole.update(chunk)
            parts.append(hashlib.sha256(chunk).digest())
            size += len(chunk)
    return whole.hexdigest(), parts, size


def expected_checksum(full_hex: str, parts: list[bytes], multipart: bool) -> str:
    """The ChecksumSHA256 S3 reports for these bytes: the sha256 (base64), or for a multipart upload the sha256
    of the parts' digests and '-N'."""
    if not multipart:
        return base64.b64encode(bytes.fromhex(full_hex)).decode()
    composite = hashlib.sha256(b"".join(parts)).digest()
    return f"{base64.b64encode(composite).decode()}-{len(parts)}"


def same_checksum(stored: str, want: str) -> bool:
    """S3 reports a multipart SHA256 as `<composite>-<parts>`; some compatible stores drop the suffix."""
    if not stored:
        return True  # a store that keeps no checksum: size and the metadata sha256 still had to match
    value, _, count = stored.partition("-")
    want_value, _, want_count = want.partition("-")
    return value == want_value and (not count or count == want_count)


def transfer_config(part_size: int = 64 << 20, concurrency: int = 8):
    """boto3's transfer settings: multipart from `part_size`, `concurrency` parts at once."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                          max_concurrency=concurrency, use_threads=concurrency > 1)


def transfer_for(client, part_size: int = 64 << 20, concurrency: int = 8):
    """A transfer manager for multipart uploads of files, made once and reused (it owns a thread pool)."""
    from boto3.s3.transfer import S3Transfer

    return S3Transfer(client, transfer_config(part_size, concurrency))


def upload_verified(client, path: Path | bytes, bucket: str, key: str, journal_sha256: str, journal_bytes: int,
                    part_size: int = 64 << 20, concurrency: int = 8, delete: bool = True,
                    transfer=None, where: str | None = None) -> Uploaded:
    """`path` is a local file, or a file's bytes held in memory (`where` then names it in errors)."""
    in_memory = not isinstance(path, Path)
    where = where or str(path)
    full, parts, size = local_digests(path, part_size)
    if full != journal_sha256 or size != journal_bytes:
        said = "it was laid out as" if in_memory else "the journal wrote"
        raise CorruptFile(f"{where}: {'in memory' if in_memory else 'on disk'} sha256 {full} / {size} bytes, but "
                          f"{said} {journal_sha256} / {journal_bytes}: not uploaded")
    multipart = size >= part_size
    if multipart:
        extra = {"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": full}}
        if not isinstance(path, Path):  # in memory
            client.upload_fileobj(io.BytesIO(path), bucket, key, ExtraArgs=extra,
                                  Config=transfer_config(part_size, concurrency))
        else:
            (transfer or transfer_for(client, part_size, concurrency)).upload_file(str(path), bucket, key,
                                                                                   extra_args=extra)
    else:  # one PUT carrying the sha256 just verified: the store checks the body against it, no re-hash here
        with (path.open("rb") if isinstance(path, Path) else io.BytesIO(path)) as body:
            client.put_object(Bucket=bucket, Key=key, Body=body, Metadata={"sha256": full},
                              ChecksumSHA256=expected_checksum(full, parts, False))
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    stored = head.get("ChecksumSHA256", "")
    want = expected_checksum(full, parts, multipart)
    recorded = head.get("Metadata", {}).get("sha256")
    if head["ContentLength"] != size or recorded != full or not same_checksum(stored, want):
        raise UploadMismatch(f"s3://{bucket}/{key}: stored {head['ContentLength']} bytes, checksum {stored or '-'}, "
                             f"metadata sha256 {head.get('Metadata', {}).get('sha256')}; sent {size} bytes, "
                             f"checksum {want}, sha256 {full}")
    if delete and isinstance(path, Path):  # not in memory
        path.unlink()
    return Uploaded(key, size, full, max(1, len(parts)) if multipart else 1, stored)


class Spool:
    """Bytes written locally but not yet uploaded. Above `high` the writer waits until below `low`."""

    def __init__(self, high: int, low: int, progress=None):
        if not 0 < low <= high:
            raise ValueError(f"spool low-water mark {low} must be in 1..high-water mark {high}")
        self.high, self.low = high, low
        self.progress = progress  # its spool_bytes / upload_paused are kept current for the heartbeat
        self.pending = 0
        self.max_pending = 0
        self.paused = False
        self.paused_s = 0.0
        self._cond = threading.Condition()

    def _publish(self) -> None:
        if self.progress is not None:
            self.progress.spool_bytes, self.progress.upload_paused = self.pending, self.paused

    def add(self, n: int) -> None:
        """Count `n` more bytes waiting (files already on disk, found at start)."""
        with self._cond:
            self.pending += n
            self.max_pending = max(self.max_pending, self.pending)
            self._publish()

    def remove(self, n: int) -> None:
        """`n` bytes left the spool (uploaded, verified, deleted): wake a writer waiting under the mark."""
        with self._cond:
            self.pending -= n
            self._publish()
            self._cond.notify_all()

    def reserve(self, n: int, failed: threading.Event) -> None:
        """Count `n` bytes about to be written, first blocking while over the high-water mark until under
        the low one (or the uploader failed). Counting at write time, not at upload submission, bounds
        the files that are being written or sealed too, not just those queued for upload."""
        with self._cond:
            if self.pending >= self.high:
                self.paused, started = True, time.monotonic()
                self._publish()
                while self.pending > self.low and not failed.is_set():
                    self._cond.wait(0.5)
                self.paused = False
                self.paused_s += time.monotonic() - started
            self.pending += n
            self.max_pending = max(self.max_pending, self.pending)
            self._publish()


class BackgroundUploader:
    """Uploads journaled batch files of one shard while extraction goes on, then mirrors its journal.

    `files_in_flight` threads take files from one queue, so the round trips of one file (hash, PUT, HEAD)
    overlap the bytes of the others; a file at or over `part_size` also goes in parallel parts.
    The mirrored journal (`<prefix>/<shard dir>/journal.jsonl`) names only files already verified in the
    store, so a journal in S3 never claims an object that is not there. It is put whenever the uploader has
    caught up, and at least every `mirror_every_s` during a backlog (a host lost in between costs the
    files uploaded since: redone elsewhere, and any second copy resolved by reconcile). The local file is
    deleted only after `upload_verified` matched it. The first error stops the uploader;
    `raise_if_failed`/`drain` surface it.

    With `memory_bytes` > 0 (`--upload-from memory`) a file can also go straight from memory: the writer
    asks `reserve_memory`, and while under that budget hands the file's bytes to `submit_memory` instead of
    writing them to disk; its journal entry is written (`on_stored`) only once the object is verified in
    the store, so the journal never names a file that is neither on disk nor in the store. Over the
    budget the writer spills to disk as usual: disk is only the overflow.
    """

    def __init__(self, store: S3Store, shard_dir: Path, spool: Spool, part_size: int = 64 << 20,
                 concurrency: int = 8, mirror_every_s: float = 10.0, files_in_flight: int = 4,
                 memory_bytes: int = 0):
        self.store = store
        self.client, self.bucket = store.client, store.bucket
        self.shard_dir = shard_dir
        self.spool = spool
        self.part_size, self.concurrency = part_size, concurrency
        self.transfer = transfer_for(store.client, part_size, concurrency)
        self.mirror_every_s = mirror_every_s
        self._mirrored_at = 0.0
        self.uploaded: set[str] = set()
        self.files_uploaded = 0
        self.bytes_uploaded = 0
        self.memory_bytes = memory_bytes
        self.in_memory = 0  # bytes held for upload from memory
        self.max_in_memory = 0
        self.files_from_memory = 0
        self.error: BaseException | None = None
        self.failed = threading.Event()
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # the counters, `uploaded`, and one mirror PUT at a time
        self._in_flight = 0
        self._stopping = False  # `stop`: queued files stay in the spool for the next run
        self._threads = [threading.Thread(target=self._run, name=f"hsextract-uploader-{i}", daemon=True)
                         for i in range(max(1, files_in_flight))]
        for thread in self._threads:
            thread.start()

    def key(self, name: str) -> str:
        """The bucket key of this shard's file `name`."""
        return self.store.key(f"{self.shard_dir.name}/{name}")

    def submit(self, entry: dict, reserved: bool = False) -> None:
        """Queue a journaled file on disk; `reserved`: its bytes were already counted by `Spool.reserve`."""
        self.raise_if_failed()
        if not reserved:
            self.spool.add(entry["bytes"])
        self._queue.put(entry)

    def reserve_memory(self, size: int) -> bool:
        """Room for `size` more bytes in memory? (then the caller must `submit_memory` them)"""
        with self._lock:
            if self.error is not None or self.in_memory + size > self.memory_bytes:
                return False
            self.in_memory += size
            self.max_in_memory = max(self.max_in_memory, self.in_memory)
            self._publish_memory()
            return True

    def submit_memory(self, entry: dict, data: bytes, on_stored) -> None:
        """Upload `data` (reserved) as `entry["file"]`; `on_stored(entry)` journals it once verified."""
        self._queue.put((entry, data, on_stored))

    def _publish_memory(self) -> None:
        if self.spool.progress is not None:
            self.spool.progress.upload_memory_bytes = self.in_memory

    def raise_if_failed(self) -> None:
        """Raise UploadFailed (with the S3 error) once the uploader gave up."""
        if self.error is not None:
            raise UploadFailed(f"upload to {self.store.uri} failed: {self.error}") from self.error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            entry, data, on_stored = item if isinstance(item, tuple) else (item, None, None)
            item = None
            if self.error is not None or self._stopping:
                if data is not None:
                    self._forget(len(data))
                continue
            with self._lock:
                self._in_flight += 1
            counted = True
            try:
                path = self.shard_dir / entry["file"]
                upload_verified(self.client, path if data is None else data, self.bucket, self.key(entry["file"]),
                                entry["sha256"], entry["bytes"], self.part_size, self.concurrency,
                                transfer=self.transfer, where=None if data is None else f"{path} (in memory)")
                if on_stored is not None:
                    on_stored(entry)  # journaled now that the store holds it, verified
                with self._lock:
                    self.uploaded.add(entry["file"])
                    self.files_uploaded += 1
                    self.bytes_uploaded += entry["bytes"]
                    if self.spool.progress is not None:
                        self.spool.progress.files_uploaded = self.files_uploaded
                        self.spool.progress.bytes_uploaded = self.bytes_uploaded
                    self._in_flight -= 1
                    counted = False
                    caught_up = self._in_flight == 0 and self._queue.empty()
                if data is None:
                    self.spool.remove(entry["bytes"])
                else:
                    data = None
                    self._forget(entry["bytes"], stored=True)
                if caught_up or time.monotonic() - self._mirrored_at >= self.mirror_every_s:
                    self.mirror_journal()  # caught up, or a while since: a backlog costs one PUT per interval
            except BaseException as exc:  # surfaced on the main thread
                self.error = self.error or exc
                self.failed.set()
                if counted:
                    with self._lock:
                        self._in_flight -= 1
                if data is not None:  # never journaled: the samples are redone by the next run
                    data = None
                    self._forget(entry["bytes"])

    def _forget(self, size: int, stored: bool = False) -> None:
        with self._lock:
            self.in_memory -= size
            self.files_from_memory += int(stored)
            self._publish_memory()

    def mirror_journal(self) -> None:
        """Put the journal, less `file` entries not yet in the store, next to the uploaded files."""
        with self._lock:
            body = b"".join(line(e) for e in read_entries(self.shard_dir / JOURNAL_NAME)
                            if e.get("kind") != "file" or e["file"] in self.uploaded)
            self.store.write(f"{self.shard_dir.name}/{JOURNAL_NAME}", body)
            self._mirrored_at = time.monotonic()

    def stop(self, wait_s: float) -> int:
        """The worker was asked to stop: start no more uploads (the files queued on disk stay in the spool,
        journaled, and the next run of the shard sends them first; those queued in memory were never journaled:
        the next run extracts their samples again), give the uploads in flight up to `wait_s` to finish,
        then mirror the journal so the store names every file verified so far. Returns the uploads still in
        flight (a multipart one left unfinished is aborted by the next run: `S3Store.abort_uploads`)."""
        self._stopping = True
        deadline = time.monotonic() + max(0.0, wait_s)
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.error is None and self.uploaded:
            self.mirror_journal()
        return self._in_flight

    def drain(self) -> None:
        """Wait until every submitted file is uploaded and verified; raise the first upload error."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self.raise_if_failed()


class UploadFailed(HsExtractError):
    """The uploader gave up (after retries) or found a mismatch: the shard cannot complete."""


def fetch_journals(store: Store, spool: Path) -> int:
    """Copy every shard journal of `store` into `spool` where the local one is absent or behind.

    Completion is by sample id across all journals, so a worker on a fresh host (or with another shard
    count) must see what other runs already put in the store. A local journal that is further along than the
    store's (its last files not mirrored yet) is kept, and takes the `lost` entries reconcile appended to the
    store's copy meanwhile. Returns how many journals it fetched."""
    local, fetched = LocalStore(spool), 0
    objects = store.list()
    sizes = {obj.key: obj.size for obj in objects}
    for key in journal_keys(objects):
        path = spool / key
        if path.exists() and path.stat().st_size == sizes[key]:
            continue
        theirs = store.read(key)
        mine = path.read_bytes() if path.exists() else b""
        if theirs.startswith(mine):  # absent or behind here: take the store's
            local.write(key, theirs)
        elif extra := retractions_missing(mine, theirs, store.where(key)):
            local.append_lines(key, b"".join(line(e) for e in extra))
        fetched += 1
    return fetched


def spool_marks(spool: Path, high: int, low: int, label: str) -> tuple[int, int]:
    """The spool's high- and low-water marks, lowered to fit the disk it is on (9/10 of what is free now, with
    the same ratio), saying so: a mark the disk cannot hold would end in a full disk, not a pause."""
    free = shutil.disk_usage(spool).free
    room = free * 9 // 10
    if high <= room:
        return high, low
    fitted_high = max(1, room)
    fitted_low = max(1, low * fitted_high // high)
    print(f"hsextract: {label}: the spool's disk ({spool}) has {free / 2**30:.2f} GiB free, less than the "
          f"high-water mark {high / 2**30:g} GiB: pausing above {fitted_high / 2**30:.3f} GiB and resuming below "
          f"{fitted_low / 2**30:.3f} GiB instead", file=sys.stderr, flush=True)
    return fitted_high, fitted_low
