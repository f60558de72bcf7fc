"""Inputs that are not yet on a host: manifests, and the content-addressed cache they are staged into.

A source is a dataset or model where its user keeps it: `s3://bucket/key` (one object) or `s3://bucket/prefix/`
(every object under it), or a file or directory on the orchestrator. Its **manifest** lists each file: path
relative to the source, size, sha256 (and for S3 the ETag it was read at). It is written once, next to the
source (`<source>.hsextract-manifest.json`), and staging checks every byte against it.

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
import json
import os
import queue
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .errors import HsExtractError, Retry
from .store.local import sha256_file, sha256_hash
from .store.s3 import error_code, split_uri

MANIFEST_SUFFIX = ".hsextract-manifest.json"
MANIFEST_VERSION = 1
PART_BYTES = 16 << 20   # one ranged GET
THREADS = 8             # ranged GETs in flight per file
_READ = 8 << 20
PRUNE_AFTER_S = 14 * 86400  # `hsextract stage prune`'s default: what no staging used for two weeks


class StageError(HsExtractError):
    """A source or a staged file is not what its manifest says, or cannot be read (names the file). `retry`:
    NOW when the store did not answer, NEVER (the default) when the source is wrong."""

    def __init__(self, message: str, retry: Retry = Retry.NEVER):
        super().__init__(message)
        self.retry = retry


@dataclass(frozen=True)
class SourceFile:
    """One file of a source: its path under the source, size, digest (None until known) and S3 ETag."""
    path: str
    size: int
    sha256: str | None = None
    etag: str | None = None


@dataclass(frozen=True)
class Manifest:
    """Every file of a source. `kind`: "file" (the source is one file, `files[0]`) or "dir"."""
    source: str
    kind: str
    files: tuple[SourceFile, ...]

    @property
    def complete(self) -> bool:
        """Every digest known."""
        return all(e.sha256 for e in self.files)

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files)

    @property
    def id(self) -> str:
        """The view's name: the same for the same bytes under the same names, wherever they come from."""
        body = json.dumps([self.kind, [(e.path, e.size, e.sha256) for e in self.files]], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:20]

    def to_json(self) -> str:
        return json.dumps({"version": MANIFEST_VERSION, "source": self.source, "kind": self.kind,
                           "files": [asdict(e) for e in self.files]}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> Manifest:
        try:
            obj = json.loads(text)
            files = tuple(SourceFile(str(f["path"]), int(f["size"]), f.get("sha256"), f.get("etag"))
                          for f in obj["files"])
            kind = obj["kind"]
        except (ValueError, KeyError, TypeError) as exc:
            raise StageError(f"{where}: not a manifest ({type(exc).__name__}: {exc})") from None
        if kind not in ("file", "dir") or (kind == "file" and len(files) != 1):
            raise StageError(f"{where}: kind {kind!r} with {len(files)} file(s)")
        for e in files:
            if e.path.startswith("/") or ".." in e.path.split("/") or not e.path:
                raise StageError(f"{where}: file path {e.path!r} leaves the source")
            if e.sha256 is not None and (len(e.sha256) != 64 or e.sha256.strip("0123456789abcdef")):
                raise StageError(f"{where}: {e.path}: {e.sha256!r} is not a sha256")
        return cls(str(obj.get("source", "")), kind, files)

    def with_digests(self, digests: dict[str, str]) -> Manifest:
        """This manifest with the digests of `digests` (path -> sha256) filled in."""
        return replace(self, files=tuple(replace(e, sha256=e.sha256 or digests.get(e.path)) for e in self.files))

    def target(self, view: Path) -> Path:
        """What a worker is given for this source staged into `view`: the file itself, or the directory."""
        return view / self.files[0].path if self.kind == "file" else view


def manifest_uri(source: str) -> str:
    """Where a source's manifest lives: next to it."""
    return source.rstrip("/") + MANIFEST_SUFFIX


# ---------------------------------------------------------------------------------------------- local sources


def local_manifest(path: Path, write: bool = True) -> Manifest:
    """The manifest of a file or directory on this machine. Kept next to it and reused while every file's size
    and mtime still match what it recorded; recomputed (and rewritten where the directory is writable) else."""
    path = Path(path)
    if not path.exists():
        raise StageError(f"{path}: no such file or directory")
    if path.is_file():
        kind, files = "file", [(path.name, path)]
    else:
        kind = "dir"
        files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*")
                       if p.is_file() and not p.name.endswith(MANIFEST_SUFFIX))
        if not files:
            raise StageError(f"{path}: an empty directory")
    stamp = {rel: [p.stat().st_size, p.stat().st_mtime_ns] for rel, p in files}
    kept = Path(str(path).rstrip("/") + MANIFEST_SUFFIX)
    try:
        old = json.loads(kept.read_text())
        if old.get("stamp") == stamp:
            return Manifest.from_json(kept.read_text(), str(kept))
    except (OSError, ValueError):
        pass
    manifest = Manifest(str(path), kind, tuple(SourceFile(rel, stamp[rel][0], sha256_file(p))
                                               for rel, p in files))
    if write:
        try:
            body = json.loads(manifest.to_json())
            body["stamp"] = stamp
            tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body, indent=1))
            os.replace(tmp, kept)
        except OSError:  # a read-only source: computed again next time
            pass
    return manifest


# ------------------------------------------------------------------------------------------------- S3 sources


def split_source(uri: str) -> tuple[str, str]:
    """(bucket, key or prefix) of an s3:// source; a trailing slash is kept (it says: a prefix)."""
    try:
        bucket, key = split_uri(uri)  # the store's parser: one reading of an S3 URI
    except ValueError as exc:
        raise StageError(f"{exc} (a source is s3://bucket/key or s3://bucket/prefix/)") from None
    return bucket, (key + "/" if key and uri.endswith("/") else key)


def list_s3(client, uri: str) -> Manifest:
    """The files of an S3 source as they are now (sizes and ETags, no digests): the object itself, else every
    object under the prefix (the manifests beside them left out)."""
    bucket, key = split_source(uri)
    if key and not key.endswith("/"):
        try:
            head = client.head_object(Bucket=bucket, Key=key)
            return Manifest(uri, "file", (SourceFile(key.rsplit("/", 1)[-1], head["ContentLength"], None,
                                                head.get("ETag", "").strip('"')),))
        except Exception as exc:
            if error_code(exc) not in ("404", "NoSuchKey", "NotFound"):
                raise StageError(f"{uri}: {type(exc).__name__}: {exc}") from None
    prefix = key.rstrip("/") + "/" if key else ""
    files = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                if rel and not rel.endswith("/") and not rel.endswith(MANIFEST_SUFFIX):
                    files.append(SourceFile(rel, obj["Size"], None, obj.get("ETag", "").strip('"')))
    except Exception as exc:
        raise StageError(f"{uri}: cannot list it: {type(exc).__name__}: {exc}") from None
    if not files:
        raise StageError(f"{uri}: no such object, and no object under {prefix or 'the bucket'}")
    return Manifest(uri, "dir", tuple(sorted(files, key=lambda e: e.path)))


def read_s3_manifest(client, uri: str) -> Manifest | None:
    """The manifest next to an S3 source, or None when there is none yet."""
    bucket, key = split_source(manifest_uri(uri))
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise StageError(f"{manifest_uri(uri)}: {type(exc).__name__}: {exc}") from None
    return Manifest.from_json(body.decode(errors="replace"), manifest_uri(uri))


def write_s3_manifest(client, manifest: Manifest) -> str:
    """Write `manifest` next to its source; returns its URI."""
    bucket, key = split_source(manifest_uri(manifest.source))
    client.put_object(Bucket=bucket, Key=key, Body=manifest.to_json().encode(), ContentType="application/json")
    return manifest_uri(manifest.source)


def s3_manifest(client, uri: str) -> Manifest:
    """The source's manifest checked against its listing now: the kept one (ETags refreshed) where it exists,
    else the listing with no digests (the first staging computes them). A file listed but not in the kept
    manifest, or one whose size changed, is a StageError naming it."""
    now = list_s3(client, uri)
    kept = read_s3_manifest(client, uri)
    if kept is None:
        return now
    listed = {e.path: e for e in now.files}
    for e in kept.files:
        got = listed.pop(e.path, None)
        if got is None:
            raise StageError(f"{uri}: {e.path} is in its manifest ({manifest_uri(uri)}) but not in S3: deleted? "
                             f"Put it back, or delete the manifest to stage what is there now")
        if got.size != e.size:
            raise StageError(f"{uri}: {e.path} is {got.size:,} bytes in S3, {e.size:,} in its manifest "
                             f"({manifest_uri(uri)}): the object changed; delete the manifest to stage it as it is now")
    if listed:
        raise StageError(f"{uri}: {sorted(listed)[0]} (and {len(listed) - 1} more) not in its manifest "
                         f"({manifest_uri(uri)}): delete the manifest to stage the source as it is now")
    return replace(kept, source=uri, kind=now.kind, files=tuple(
        replace(e, etag=next(g.etag for g in now.files if g.path == e.path)) for e in kept.files))


# ------------------------------------------------------------------------------------------------- the cache


@dataclass(eq=False)
class _Fetch:
    """One file on its way from S3 into a cache."""
    entry: SourceFile
    source: str
    bucket: str
    key: str
    part: Path
    done: Fetched
    hash: object = None


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
                    done.digests[entry.path] = self.known(entry, manifest.source)
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
                    done.digests[e.path] = self.known(e, manifest.source)
                    done.kept_files += 1
                else:
                    obj = prefix if manifest.kind == "file" else prefix + e.path
                    todo.append(_Fetch(e, manifest.source, bucket, obj, self.partial(e, manifest.source), done))
        if todo:
            self._stream(client, todo, host, threads, part_bytes)
            for f in todo:
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
