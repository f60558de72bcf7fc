"""The content-addressed cache a host's inputs are staged into (`hsextract stage`), checked against their manifests
(`hsextract.data.sources`).

A host's **cache** (`<workdir>/inputs`) keeps each file once, by content: `blobs/<sha256>`. A file on its way
is `partial/<name>.part`, appended in order, so a staging cut short resumes from its size; it becomes a blob
only once its size and digest are right. A source's **view** (`views/<id>/...`, `id` from the manifest's
digests) lays its files out under their own names as hard links to the blobs: the worker reads the view like
any local dataset or model directory.

From S3 the host fetches each missing file itself, in parallel ranged GETs written and hashed in order
(`fetch`). From the orchestrator, the file is sent over SFTP into its partial, then `place` hashes it. A
source with no manifest yet is fetched all the same: each host computes the digests as it fetches, and the
orchestrator writes the manifest once the hosts agree (tasks/stage.py).
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hsextract.data.sources import Manifest, SourceFile, StageError, manifest_uri, split_source
from hsextract.errors import Retry
from hsextract.store.local import sha256_hash
from hsextract.store.s3 import error_code

PART_BYTES = 16 << 20   # one ranged GET
THREADS = 8             # ranged GETs in flight per file
_READ = 8 << 20
PRUNE_AFTER_S = 14 * 86400  # `hsextract stage prune`'s default: what no staging used for two weeks

if TYPE_CHECKING:
    from _hashlib import HASH


@dataclass(eq=False)
class _Fetch:
    """One file on its way from S3 into a cache."""
    entry: SourceFile
    source: str
    bucket: str
    key: str
    part: Path
    done: Fetched
    hash: HASH | None = None  # the sha256 of what its partial file holds (`_resume` starts it)


@dataclass
class Fetched:
    """What staging one source into a cache did."""
    digests: dict[str, str] = field(default_factory=dict)   # path -> sha256 of every file of the source
    sent_bytes: int = 0        # fetched (or received) this time
    resumed_bytes: int = 0     # already in partial files, not fetched again
    kept_files: int = 0        # already blobs: nothing fetched
    seconds: float = 0.0


def _resume(f: _Fetch, part_bytes: int) -> list[tuple[_Fetch, int, int]]:
    """The byte ranges of `f` still to fetch into its partial file (what a cut-short staging left is kept and
    hashed again; more than the file's size is dropped), in parts of `part_bytes`."""
    f.part.parent.mkdir(parents=True, exist_ok=True)
    have = f.part.stat().st_size if f.part.exists() else 0
    if have > f.entry.size:
        f.part.unlink()
        have = 0
    f.hash = sha256_hash(f.part) if have else hashlib.sha256()
    f.done.resumed_bytes += have
    if f.entry.size == 0:
        f.part.touch()
    return [(f, s, min(s + part_bytes, f.entry.size)) for s in range(have, f.entry.size, part_bytes)]


def _get_range(client, f: _Fetch, start: int, end: int, host: str) -> bytes:
    """Bytes [start, end) of `f`'s object, as listed (its ETag); StageError naming host, source, file and range
    (retry NEVER when the object is gone, changed or not ours to read)."""
    kwargs = {"IfMatch": f'"{f.entry.etag}"'} if f.entry.etag else {}
    where = f"GET s3://{f.bucket}/{f.key} bytes {start}-{end - 1}"
    try:
        data = client.get_object(Bucket=f.bucket, Key=f.key, Range=f"bytes={start}-{end - 1}", **kwargs)["Body"].read()
    except Exception as exc:
        code = error_code(exc)
        gone, changed = code in ("NoSuchKey", "404"), code == "PreconditionFailed"
        why = ("the object is gone (deleted since the manifest was read)" if gone
               else "the object changed since it was listed (ETag)" if changed
               else f"{type(exc).__name__}: {exc}")
        raise StageError(f"{host}: {f.source}: {f.entry.path}: {where}: {why}",
                         retry=Retry.NEVER if gone or changed or code in ("AccessDenied", "NoSuchBucket")
                         else Retry.NOW) from None
    if len(data) != end - start:
        raise StageError(f"{host}: {f.source}: {f.entry.path}: {where} returned {len(data):,} bytes")
    return data


class Cache:
    """A host's content-addressed store of staged files (see the module's docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def blob(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256[:2] / sha256

    def partial(self, entry: SourceFile, source: str) -> Path:
        """Where `entry` is fetched to: named by its digest where known, else by the source, path and ETag."""
        name = entry.sha256 or hashlib.sha256(
            "\0".join((source, entry.path, entry.etag or "", str(entry.size))).encode()).hexdigest()
        return self.root / "partial" / f"{name}.part"

    def known(self, entry: SourceFile, source: str) -> str | None:
        """The digest of `entry`: the manifest's, or the one this cache computed when it fetched the same object
        (same source, path, ETag and size) before a manifest existed."""
        if entry.sha256:
            return entry.sha256
        try:
            return (self.root / "known" / self.partial(entry, source).name.removesuffix(".part")).read_text().strip()
        except OSError:
            return None

    def has(self, entry: SourceFile, source: str) -> bool:
        sha = self.known(entry, source)
        try:
            return sha is not None and self.blob(sha).stat().st_size == entry.size
        except OSError:
            return False

    def status(self, manifest: Manifest) -> dict:
        """What staging `manifest` here needs: bytes missing (less what partial files hold), the free space."""
        self.root.mkdir(parents=True, exist_ok=True)
        missing = partial = present = 0
        for e in manifest.files:
            if self.has(e, manifest.source):
                present += e.size
                continue
            part = self.partial(e, manifest.source)
            held = min(part.stat().st_size, e.size) if part.exists() else 0
            partial += held
            missing += e.size - held
        st = os.statvfs(self.root)
        return {"missing_bytes": missing, "partial_bytes": partial, "present_bytes": present,
                "free_bytes": st.f_bavail * st.f_frsize, "cache": str(self.root)}

    def follow(self, manifests: list[Manifest], host: str = "this host", abort: Path | None = None,
               stall_s: float = 120.0, poll_s: float = 0.02) -> list[Fetched]:
        """Verify each file of `manifests` that is not a blob yet against its entry (size, and digest where the
        manifest has one) and make it the blob; a wrong one is removed (the next staging sends it again) and
        named. The files may still be arriving (sent into their partial files, in manifest order): each is
        hashed as it grows, so its digest is ready when its last byte lands. StageError when `abort` appears
        (the sender failed) or no byte arrives for `stall_s` (0: every file must be complete already)."""
        results = []
        buf = bytearray(_READ)
        view = memoryview(buf)
        for manifest in manifests:
            done = Fetched()
            results.append(done)
            for entry in manifest.files:
                if self.has(entry, manifest.source):
                    done.kept_files += 1
                    sha = self.known(entry, manifest.source)
                    assert sha is not None  # `has` found it
                    done.digests[entry.path] = sha
                    continue
                part = self.partial(entry, manifest.source)
                where = f"{host}: {manifest.source}: {entry.path}"
                h, pos, last, f = hashlib.sha256(), 0, time.monotonic(), None
                try:
                    while pos < entry.size:
                        if abort is not None and abort.exists():
                            raise StageError(f"{where}: the send stopped at {pos:,} of {entry.size:,} bytes")
                        if f is None:
                            try:
                                f = open(part, "rb", buffering=0)
                            except FileNotFoundError:
                                pass
                        n = f.readinto(view[:min(_READ, entry.size - pos)]) if f is not None else 0
                        if n:
                            h.update(view[:n])
                            pos += n
                            last = time.monotonic()
                        elif time.monotonic() - last > stall_s:
                            raise StageError(f"{where}: no byte arrived for {stall_s:.0f}s ({pos:,} of "
                                             f"{entry.size:,} bytes in {part})")
                        else:
                            time.sleep(poll_s)
                finally:
                    if f is not None:
                        f.close()
                size = part.stat().st_size
                if size != entry.size:
                    raise StageError(f"{where}: {size:,} bytes staged, {entry.size:,} expected")
                done.digests[entry.path] = self._place(part, entry, manifest.source, h.hexdigest(), host)
        return results

    def _place(self, part: Path, entry: SourceFile, source: str, sha: str, host: str) -> str:
        if entry.sha256 and sha != entry.sha256:
            part.unlink(missing_ok=True)
            raise StageError(f"{host}: {source}: {entry.path}: sha256 {sha} does not match its manifest's "
                             f"{entry.sha256} (removed; the object differs from what the manifest recorded: fix the "
                             f"object or delete the stale manifest {manifest_uri(source)})")
        blob = self.blob(sha)
        blob.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(part, 0o440)
        os.replace(part, blob)
        if not entry.sha256:
            known = self.root / "known"
            known.mkdir(exist_ok=True)
            (known / part.name.removesuffix(".part")).write_text(sha + "\n")
        return sha

    def view(self, manifest: Manifest) -> Path:
        """The source laid out under its own names (hard links to the blobs), built once; the worker's path."""
        if not manifest.complete:
            raise StageError(f"{manifest.source}: a view needs every digest")
        final = self.root / "views" / manifest.id
        if final.is_dir():
            os.utime(final)  # its last use, for `prune`
            return manifest.target(final)
        tmp = final.with_name(f".{manifest.id}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        for e in manifest.files:
            dest = tmp / e.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            assert e.sha256 is not None  # the manifest is complete
            blob = self.blob(e.sha256)
            if not blob.is_file():
                raise StageError(f"{manifest.source}: {e.path} ({e.sha256[:12]}) is not staged in {self.root}")
            try:
                os.link(blob, dest)
            except OSError:  # another file system, or no hard links: a symlink serves the reader as well
                os.symlink(blob, dest)
        try:
            os.rename(tmp, final)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
        return manifest.target(final)

    def prune(self, older_than_s: float = PRUNE_AFTER_S, keep: tuple[str, ...] = (), dry_run: bool = False) -> dict:
        """Free what no staging has used for `older_than_s`: the views not staged since (their files unlinked;
        the ids in `keep` stay whatever their age), then the blobs that no view left links to and that were not
        written since (a staging under way keeps what it just placed), the partial files not appended to since,
        and the digests recorded for blobs that are gone. What was removed (with `dry_run`: would be), and its
        bytes (blobs and partial files: a view's links hold no bytes of their own)."""
        cutoff = time.time() - older_than_s
        out = {"views": 0, "blobs": 0, "partial": 0, "bytes": 0, "kept_views": 0, "kept_blobs": 0}
        views = self.root / "views"
        pruned: set[Path] = set()
        for view in sorted(views.iterdir()) if views.is_dir() else ():
            if view.name in keep or view.lstat().st_mtime >= cutoff:
                out["kept_views"] += 1
                continue
            pruned.add(view)
            out["views"] += not view.name.startswith(".")  # a view left half-built by a killed staging: no count
            if not dry_run:
                shutil.rmtree(view)
        links: dict[tuple, int] = {}  # inode -> its hard links from the views pruned (a dry run counts them off)
        linked = set()  # blobs symlinked from the views kept (where the file system has no hard links)
        for view in sorted(views.iterdir()) if views.is_dir() else ():
            gone = view in pruned
            for p in view.rglob("*"):
                if p.is_symlink():
                    if not gone:
                        linked.add(os.path.realpath(p))
                elif gone and p.is_file():
                    st = p.stat()
                    links[st.st_dev, st.st_ino] = links.get((st.st_dev, st.st_ino), 0) + 1
        for blob in sorted((self.root / "blobs").glob("*/*")):
            st = blob.stat()
            others = st.st_nlink - 1 - links.get((st.st_dev, st.st_ino), 0)  # links from the views kept
            if others > 0 or st.st_mtime >= cutoff or os.path.realpath(blob) in linked:
                out["kept_blobs"] += 1
                continue
            if not dry_run:
                blob.unlink()
            out["blobs"] += 1
            out["bytes"] += st.st_size
        for part in sorted((self.root / "partial").glob("*")):
            st = part.stat()
            if part.is_file() and st.st_mtime < cutoff:
                if not dry_run:
                    part.unlink()
                out["partial"] += 1
                out["bytes"] += st.st_size
        for known in sorted((self.root / "known").glob("*")) if not dry_run else ():
            if not self.blob(known.read_text().strip()).exists():
                known.unlink()
        return out

    # ------------------------------------------------------------------------------------------- fetch from S3

    def fetch(self, client, manifests: list[Manifest], host: str = "this host", threads: int = THREADS,
              part_bytes: int = PART_BYTES) -> list[Fetched]:
        """Stage every file of the S3 sources `manifests` here (what is already here is kept): the space for all
        of them checked first, then one stream of ranged GETs over all their missing files, `threads` in flight,
        each file written and hashed in order. What each source holds, with the digests of all its files."""
        started = time.monotonic()
        states = [self.status(m) for m in manifests]
        need = sum(st["missing_bytes"] for st in states)
        free = states[0]["free_bytes"] if states else 0
        if need > free:
            raise StageError(f"{host}: staging {', '.join(m.source for m in manifests)} needs {need:,} more bytes "
                             f"in {self.root}, which has {free:,} free")
        results, todo = [], []
        for manifest in manifests:
            done = Fetched()
            results.append(done)
            bucket, key = split_source(manifest.source)
            prefix = key if manifest.kind == "file" else (key.rstrip("/") + "/" if key else "")
            for e in manifest.files:
                if self.has(e, manifest.source):
                    sha = self.known(e, manifest.source)
                    assert sha is not None  # `has` found it
                    done.digests[e.path] = sha
                    done.kept_files += 1
                else:
                    obj = prefix if manifest.kind == "file" else prefix + e.path
                    todo.append(_Fetch(e, manifest.source, bucket, obj, self.partial(e, manifest.source), done))
        if todo:
            self._stream(client, todo, host, threads, part_bytes)
            for f in todo:
                assert f.hash is not None  # `_resume` started it
                f.done.digests[f.entry.path] = self._place(f.part, f.entry, f.source, f.hash.hexdigest(), host)
        for done in results:
            done.seconds = round(time.monotonic() - started, 3)
        return results

    def _stream(self, client, todo: list[_Fetch], host: str, threads: int, part_bytes: int) -> None:
        """Fetch the rest of every file of `todo` into its partial file, in order, hashing as it goes."""
        parts = [part for f in todo for part in _resume(f, part_bytes)]
        window: queue.Queue = queue.Queue()
        slots = threading.BoundedSemaphore(threads * 2)  # parts fetched but not yet written: bounded memory
        stop = threading.Event()

        def feed():
            for f, start, end in parts:
                slots.acquire()
                if stop.is_set():
                    break
                window.put((f, pool.submit(_get_range, client, f, start, end, host)))
            window.put(None)

        out, current = None, None
        with ThreadPoolExecutor(threads, thread_name_prefix="stage-get") as pool:
            feeder = threading.Thread(target=feed, daemon=True, name="stage-feed")
            feeder.start()
            try:
                while (item := window.get()) is not None:
                    f, future = item
                    try:
                        data = future.result()
                    finally:
                        slots.release()
                    if f is not current:
                        if out is not None:
                            out.close()
                        out, current = open(f.part, "ab", buffering=0), f
                        os.fchmod(out.fileno(), 0o640)
                    assert out is not None  # opened for the first part (`current` starts None)
                    out.write(data)
                    f.hash.update(data)
                    f.done.sent_bytes += len(data)
            except BaseException:
                stop.set()
                while feeder.is_alive() or not window.empty():  # the feeder waits on slots: free them
                    try:
                        item = window.get(timeout=0.1)
                        if item is not None:
                            item[1].cancel()
                            slots.release()
                    except queue.Empty:
                        pass
                raise
            finally:
                if out is not None:
                    out.close()

    # ---------------------------------------------------------------------------------- receive (from SFTP)

    def offsets(self, manifest: Manifest) -> dict[str, int]:
        """For each file not yet a blob: how many bytes its partial holds (where a sender resumes)."""
        out = {}
        for e in manifest.files:
            if not self.has(e, manifest.source):
                part = self.partial(e, manifest.source)
                out[e.path] = part.stat().st_size if part.exists() else 0
        return out
