"""Where an extraction's output lives: one interface over a local directory and an S3 prefix.

`open_store(uri)` is the one place that tells a local output (a path, or `file://...`) from `s3://bucket/prefix`;
everything else (the worker's resume and upload, the reader, the flow's planning, reconcile) works on a
`Store` and does not ask which. Keys are relative to the output's root and `/`-separated
(`shard-00000-of-00004/batch-000001.safetensors`). `scan(store)` reads every shard journal in it and
merges them (hsextract.journal): what is written, skipped, lost and done, by sample id and by shard.

No torch here, and boto3 is imported only when an S3 store is made: the orchestrator uses this module too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .journal import JOURNAL_NAME, OutputState, intact_prefix, merge_journals, parse_entries, repair_tail

FILE_MODE = 0o640  # what the product writes: the group may read, others may not


class StoreError(Exception):
    """A store refused a request or could not be reached; the message names the URI."""


class NoSuchBucket(StoreError):
    """The bucket of an `s3://` output does not exist: nothing can be stored there until it is created."""


@dataclass(frozen=True)
class StoredObject:
    """One object of a listing: its key under the output root, its size, and (asked for) its sha256 (hex)."""

    key: str
    size: int
    sha256: str | None = None


# ---------------------------------------------------------------------------------------------------------------
# files on this machine


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Write `data` at `path` so that a reader sees the old file or the new one, never a part: a temp file
    (with `mode` from its creation), fsync, rename into place. Concurrent writers of one path each use their
    own temp file; the last rename wins."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.{os.getpid()}.tmp")  # a worker's own end in .PID.tmp
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------------------------
# S3 addresses and clients

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of `s3://bucket/prefix`. Refuses what could put a key
    outside the prefix or be read two ways: `.` or `..` segments, empty segments, control characters."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise ValueError(f"{uri!r}: expected s3://bucket/prefix")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"{uri!r}: bucket {bucket!r} is not a valid S3 bucket name (3-63 of a-z 0-9 . -)")
    prefix = prefix.strip("/")
    bad = [segment for segment in prefix.split("/") if segment in ("", ".", "..")] if prefix else []
    if bad or _CONTROL.search(prefix):
        what = f"segment {bad[0]!r}" if bad else "a control character"
        raise ValueError(f"{uri!r}: the prefix holds {what}: object keys must stay under one plain prefix")
    return bucket, prefix


def s3_client(endpoint_url: str | None = None, attempts: int = 8, **kwargs):
    """A boto3 S3 client: standard retries (5xx, throttling, resets) up to `attempts`, bounded connect and read
    times, checksums computed and validated where the API supports them. `session=` picks a boto3 Session
    (a profile); other keyword arguments go to `client()` (keys, region)."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                    request_checksum_calculation="when_supported", response_checksum_validation="when_supported")
    session = kwargs.pop("session", None) or boto3
    return session.client("s3", endpoint_url=endpoint_url, config=config, **kwargs)


def _error_code(exc: Exception) -> str:
    return getattr(exc, "response", {}).get("Error", {}).get("Code", "")


_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict")


# ---------------------------------------------------------------------------------------------------------------
# the interface


class Store(ABC):
    """An output's objects by key. Reads of a missing key raise FileNotFoundError. `write` replaces atomically;
    `create` writes only if absent; `replace` writes only if the object is still the version `read_tagged`
    returned: with them, `update` and `append_lines` never lose a concurrent writer's change."""

    uri: str

    @abstractmethod
    def list(self, checksums: bool = False) -> list[StoredObject]:
        """Every object under the root; `checksums`: with the sha256 of each batch file, where one is known."""

    @abstractmethod
    def read_tagged(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and a tag of this version (for `replace`)."""

    def read(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when it is absent."""
        return self.read_tagged(key)[0]

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Create or replace `key` with `data`, atomically."""

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist; False if it does (someone else claimed it)."""

    @abstractmethod
    def replace(self, key: str, data: bytes, tag: str) -> bool:
        """Write `key` only if it is still the version tagged `tag`; False if it changed since."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` (nothing if it is absent)."""

    @abstractmethod
    def checksum(self, key: str) -> str | None:
        """The object's sha256 (hex): computed from the bytes locally, the one stored with it on S3."""

    def local_path(self, key: str) -> Path | None:
        """Where `key` is on this machine's file system, for a store that is one (None otherwise)."""
        return None

    def where(self, key: str) -> str:
        """A URI naming `key`, for messages."""
        return f"{self.uri.rstrip('/')}/{key}"

    def update(self, key: str, change: Callable[[bytes | None], bytes], attempts: int = 12) -> bytes:
        """Replace `key` with `change(current bytes, or None when absent)`; when another writer changed it in
        between, wait a little (random, growing) and read again, up to `attempts` times. Returns what was
        written; StoreError when every attempt lost the race."""
        for attempt in range(attempts):
            try:
                data, tag = self.read_tagged(key)
            except FileNotFoundError:
                new = change(None)
                if self.create(key, new):
                    return new
            else:
                new = change(data)
                if self.replace(key, new, tag):
                    return new
            time.sleep(random.uniform(0, 0.005 * 2 ** min(attempt, 6)))  # apart from the other writers
        raise StoreError(f"{self.where(key)}: changed under each of {attempts} attempts to update it")

    def append_lines(self, key: str, lines: bytes) -> None:
        """Append whole lines to a line log (a journal), after its last complete line: a torn last line, an
        append that never completed, is cut first. The object must exist."""
        self.read(key)  # FileNotFoundError when absent, as documented
        self.update(key, lambda data: intact_prefix(data or b"") + lines)


def open_store(uri: str | Path, client=None, create: bool = False) -> Store:
    """The store of an output: `s3://bucket/prefix`, or a local directory given as a path or `file://` URI
    (`create`: make it if absent). For S3, `client` is a boto3 client or a function that makes one (called
    only then); without it, boto3's default credential chain and $AWS_ENDPOINT_URL."""
    text = str(uri)
    if text.startswith("s3://"):
        return S3Store(text, client() if callable(client) else client)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"{text!r}: expected a local path, file:// or s3:// URI")
    return LocalStore(text.removeprefix("file://"), create=create)


# ---------------------------------------------------------------------------------------------------------------
# a local directory


class LocalStore(Store):
    """A directory on this machine (`file://` outputs, a worker's spool): a real destination, not a mock.
    Conditional writes hold an advisory lock on the object's directory while they compare and rename."""

    def __init__(self, root: str | Path, create: bool = False):
        self.root = Path(root)
        self.uri = f"file://{self.root}"
        if create:
            make_dirs(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def list(self, checksums: bool = False) -> list[StoredObject]:
        found = []
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                try:
                    size = path.stat().st_size
                except FileNotFoundError:  # removed while listing (a temp file renamed away)
                    continue
                digest = sha256_file(path) if checksums and key.endswith(".safetensors") else None
                found.append(StoredObject(key, size, digest))
        return sorted(found, key=lambda o: o.key)

    def read_tagged(self, key: str) -> tuple[bytes, str]:
        """The tag is the content's sha256: inode, size and mtime can all repeat within one clock tick."""
        data = self._path(key).read_bytes()
        return data, hashlib.sha256(data).hexdigest()

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        make_dirs(path.parent)
        write_atomic(path, data)

    @contextlib.contextmanager
    def _locked(self, path: Path):
        make_dirs(path.parent)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with self._locked(path):
            if path.exists():
                return False
            write_atomic(path, data)
            fsync_dir(path.parent)
        return True

    def replace(self, key: str, data: bytes, tag: str) -> bool:
        path = self._path(key)
        with self._locked(path):
            try:
                if self.read_tagged(key)[1] != tag:
                    return False
            except FileNotFoundError:
                return False
            write_atomic(path, data)
        return True

    def append_lines(self, key: str, lines: bytes) -> None:
        """In place (O_APPEND), so a writer that holds the log open keeps appending to the same file."""
        path = self._path(key)
        repair_tail(path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, lines)
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def checksum(self, key: str) -> str | None:
        return sha256_file(self._path(key))


def make_dirs(path: Path, umask: int = 0o027) -> None:
    """`mkdir -p` with modes under `umask` (pathlib makes missing parents with the process's umask, often 022)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o777 & ~umask)


# ---------------------------------------------------------------------------------------------------------------
# an S3 prefix


class S3Store(Store):
    """`s3://bucket/prefix` on any S3-compatible endpoint. `create` is a PUT with If-None-Match: *, `replace` a PUT
    with If-Match on the ETag `read_tagged` returned; every PUT carries a SHA256 checksum the store verifies."""

    def __init__(self, uri: str, client=None):
        self.bucket, self.prefix = split_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.client = client or s3_client()

    def key(self, key: str) -> str:
        """The object key in the bucket of `key` (relative to the output root)."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, fn, key: str | None, **kwargs):
        """`fn(Bucket=..., Key=..., **kwargs)`, with the errors a caller acts on made plain: NoSuchBucket, and a
        missing key as FileNotFoundError."""
        from botocore.exceptions import ClientError

        try:
            return fn(Bucket=self.bucket, **({"Key": self.key(key)} if key is not None else {}), **kwargs)
        except ClientError as exc:
            code = _error_code(exc)
            if code == "NoSuchBucket":
                raise NoSuchBucket(f"{self.uri}: the bucket {self.bucket!r} does not exist (NoSuchBucket from "
                                   f"{self.client.meta.endpoint_url}): create it, or fix the output") from None
            if code in ("NoSuchKey", "404") and key is not None:
                raise FileNotFoundError(f"{self.where(key)}: no such object") from None
            raise

    def list(self, checksums: bool = False) -> list[StoredObject]:
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self._call(lambda **kw: list(self.client.get_paginator("list_objects_v2").paginate(**kw)), None,
                           Prefix=base)
        found = [StoredObject(o["Key"][len(base):], o["Size"]) for page in pages for o in page.get("Contents", [])]
        if not checksums:
            return found

        def with_checksum(obj: StoredObject) -> StoredObject:
            if not obj.key.endswith(".safetensors"):
                return obj
            return StoredObject(obj.key, obj.size, self.checksum(obj.key))

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(32) as pool:
            return list(pool.map(with_checksum, found))

    def read_tagged(self, key: str) -> tuple[bytes, str]:
        got = self._call(self.client.get_object, key)
        return got["Body"].read(), got["ETag"]

    def write(self, key: str, data: bytes) -> None:
        self._call(self.client.put_object, key, Body=data, ChecksumAlgorithm="SHA256")

    def _put_if(self, key: str, data: bytes, **condition) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._call(self.client.put_object, key, Body=data, ChecksumAlgorithm="SHA256", **condition)
        except ClientError as exc:
            if _error_code(exc) in _CONFLICT:
                return False
            raise
        return True

    def create(self, key: str, data: bytes) -> bool:
        return self._put_if(key, data, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, tag: str) -> bool:
        return self._put_if(key, data, IfMatch=tag)

    def delete(self, key: str) -> None:
        self._call(self.client.delete_object, key)

    def checksum(self, key: str) -> str | None:
        """The sha256 the uploader stored as metadata (S3 verified the bytes against it when they arrived)."""
        head = self._call(self.client.head_object, key)
        return head.get("Metadata", {}).get("sha256")


# ---------------------------------------------------------------------------------------------------------------
# what the journals say


def journal_keys(objects: Iterable[StoredObject]) -> list[str]:
    """Keys of the shard journals in a listing (`shard-*/journal.jsonl`), sorted."""
    keys = []
    for obj in objects:
        parts = obj.key.split("/")
        if len(parts) == 2 and parts[0].startswith("shard-") and parts[1] == JOURNAL_NAME:
            keys.append(obj.key)
    return sorted(keys)


def scan(store: Store | str | Path, checksums: bool = False) -> OutputState:
    """Every shard journal in `store` (a Store, or an output's path or URI: `open_store`), any shard count,
    merged; the listing is kept in `objects`. `checksums`: the listing carries each batch file's sha256
    (every file read locally, a HEAD per object on S3)."""
    store = store if isinstance(store, Store) else open_store(store)
    objects = store.list(checksums)
    journals = [(key.split("/")[0], list(parse_entries(store.read(key), store.where(key))))
                for key in journal_keys(objects)]
    state = merge_journals(journals)
    state.objects = {o.key: o for o in objects}
    return state
