"""The storage interface every output is used through: `Store`, its objects, its errors."""

from __future__ import annotations

import json
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hsextract.errors import HsExtractError

FILE_MODE = 0o640  # what the product writes: the group may read, others may not



def intact_prefix(data: bytes) -> bytes:
    """What of a line log's bytes (a journal's) to keep before appending: every complete line. A last line
    that lost only its newline is a whole entry (readers return it) and gets the newline back; a torn one is
    dropped."""
    keep = data.rfind(b"\n") + 1
    if keep == len(data):
        return data
    try:
        json.loads(data[keep:])
    except json.JSONDecodeError:
        return data[:keep]
    return data + b"\n"


class StoreError(HsExtractError):
    """A store refused a request or could not be reached; the message names the URI."""


class NoSuchBucket(StoreError):
    """The bucket of an `s3://` output does not exist: nothing can be stored there until it is created."""


@dataclass(frozen=True)
class StoredObject:
    """One object of a listing: its key under the output root, its size, and (asked for) its sha256 (hex)."""

    key: str
    size: int
    sha256: str | None = None


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

    def read_into(self, key: str, buffer) -> int:
        """The object's bytes written into `buffer` (writable, at least as long); how many there were.
        ValueError when the object is longer than `buffer`."""
        data = self.read(key)
        if len(data) > len(buffer):
            raise ValueError(f"{self.where(key)}: {len(data)} bytes, expected at most {len(buffer)}")
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

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
