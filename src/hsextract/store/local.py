"""A local directory as a store (`file://` outputs, a worker's spool), and the file helpers the worker uses too:
the sha256 of a file, durable renames, atomic writes, directories made under the product's umask."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import uuid
from pathlib import Path

from hsextract.store.base import FILE_MODE, Store, StoredObject, intact_prefix


def sha256_hash(path: Path, chunk: int = 8 << 20):
    """The sha256 object of a file, read in chunks (its `update` may go on with what follows the file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    return sha256_hash(path, chunk).hexdigest()


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



def repair_tail(path: Path) -> None:
    """`intact_prefix` applied to a line log file (a journal) in place (truncate, or add the newline), made durable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    keep = intact_prefix(data)
    if keep == data:
        return
    with path.open("r+b") as handle:
        if len(keep) < len(data):
            handle.truncate(len(keep))
        else:
            handle.seek(0, os.SEEK_END)
            handle.write(b"\n")
        os.fsync(handle.fileno())


class LocalStore(Store):
    """A directory on this machine (`file://` outputs, a worker's spool): a real destination, not a mock.
    Conditional writes hold an advisory lock on the object's directory while they compare and rename."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.uri = f"file://{self.root}"

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
