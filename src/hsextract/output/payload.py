"""A safetensors file laid out over the tensors' own memory and written atomically; no torch.

`layout` makes the file (`Payload`: its header and views of each tensor's bytes, nothing copied) from
(name, safetensors dtype, shape, bytes) entries in the order `safetensors.torch.save` uses; `write_unsealed`
copies it to a temp file, `Unsealed.seal` makes it durable and puts it in place. `hsextract.output.batchfile` builds
the entries from torch tensors; the synthetic worker (no torch) from buffers of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hsextract.store import fsync_dir

if TYPE_CHECKING:
    from typing_extensions import Buffer

FORMAT_VERSION = "1"
#: the metadata key of the xxh3-128 (hex) of a batch file's data: every byte after its header
DATA_CHECKSUM = "data_xxh3"

#: safetensors' dtype names, in the order of its Dtype enum (tensors of one element size sort by it, larger first)
DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64")
ELEMENT_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "F16": 2, "BF16": 2, "I32": 4,
                "F32": 4, "F64": 8, "I64": 8}


@dataclass(frozen=True)
class WrittenFile:
    """A batch file made durable and put in place: its name, size, sha256 and xxh3-128 (hex)."""
    name: str
    bytes: int
    sha256: str
    xxh3: str | None = None


@dataclass
class Payload:
    """A batch file as its safetensors header and views of the tensors' own memory: nothing is copied.

    The views stay valid while `tensors` live; a writer sends `parts` to the file in order. `sha256` is
    None until `hash()` ran (a writer may hash several files at once on other threads: hashlib releases
    the GIL on large buffers, and one core hashes slower than a fast disk writes)."""

    parts: list  # bytes (the header) and memoryviews (the tensors' data)
    size: int
    sha256: str | None
    tensors: list = field(repr=False)
    xxh3: str | None = None  # of the whole file, beside the sha256 (readers check it: ~30 GB/s against ~2)

    def hash(self) -> str:
        """Compute (and keep) the sha256 and xxh3-128 of the parts, in order; returns the sha256."""
        import xxhash

        digest, fast = hashlib.sha256(), xxhash.xxh3_128()
        for part in self.parts:
            digest.update(part)
            fast.update(part)
        self.sha256, self.xxh3 = digest.hexdigest(), fast.hexdigest()
        return self.sha256

    def tobytes(self) -> bytes:
        """The whole file as one bytes object (for an upload from memory)."""
        return b"".join(self.parts)  # one copy, made with the GIL released


@dataclass
class Prepared:
    """A batch file laid out and hashed (its data still in the staging buffers), waiting to be written."""

    name: str
    payload: Payload
    ids: list[str]
    lengths: list[int]
    rms: list | None = None  # per captured layer, the RMS of the batch's states (journaled with the file)
    provenance: dict | None = None  # per sample: "tokens_xxh3" of its token ids, "records_xxh3" of its record


@dataclass(frozen=True)
class TensorBytes:
    """One tensor of a file: its safetensors dtype name, shape and contiguous bytes (any buffer)."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Buffer  # bytes, bytearray, memoryview or anything with the buffer protocol; kept alive by the Payload


def layout(entries: list[TensorBytes], metadata: dict[str, str], hashed: bool = True) -> Payload:
    """The safetensors layout of `entries` (data sorted by element size, then dtype, then name; the header
    padded to 8 bytes, as `safetensors.torch.save` makes it) and, if `hashed`, its sha256; nothing copied. The
    metadata gets the data's xxh3-128 (`DATA_CHECKSUM`): a file read alone proves its bytes too."""
    import xxhash

    rank = {name: i for i, name in enumerate(DTYPE_ORDER)}
    parts: list[bytes | memoryview] = []  # the header (inserted first, once known), then the tensors' data
    header_entries, kept, offset = {}, [], 0
    for entry in sorted(entries, key=lambda e: (-ELEMENT_SIZE[e.dtype], -rank[e.dtype], e.name)):
        view = memoryview(entry.data).cast("B")
        size = view.nbytes
        expected = ELEMENT_SIZE[entry.dtype]
        for dim in entry.shape:
            expected *= dim
        if size != expected:
            raise ValueError(f"tensor {entry.name!r}: {size} bytes for {entry.dtype} {list(entry.shape)}")
        header_entries[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                                      "data_offsets": [offset, offset + size]}
        offset += size
        if size:
            parts.append(view)
            kept.append(entry.data)
    data_digest = xxhash.xxh3_128()
    for part in parts:
        data_digest.update(part)
    metadata = dict(sorted({"format_version": FORMAT_VERSION, **metadata, DATA_CHECKSUM: data_digest.hexdigest()}
                           .items()))  # in the order safetensors writes them (sorted)
    header = json.dumps({"__metadata__": metadata, **header_entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    parts.insert(0, len(header).to_bytes(8, "little") + header)
    payload = Payload(parts, 8 + len(header) + offset, None, kept)
    if hashed:
        payload.hash()
    return payload


@dataclass
class Unsealed:
    """A batch file written to its temp name, not yet durable nor in place."""

    path: Path
    tmp: Path
    fd: int
    size: int
    sha256: str
    xxh3: str | None = None

    def seal(self) -> WrittenFile:
        """fsync, rename into place, fsync the directory: from here on the file survives a crash."""
        try:
            try:
                os.fsync(self.fd)
            finally:
                os.close(self.fd)
        except OSError as exc:  # a full or failing disk shows up here too: name the file
            self.tmp.unlink(missing_ok=True)
            raise OSError(exc.errno, exc.strerror, str(self.tmp)) from exc
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return WrittenFile(self.path.name, self.size, self.sha256, self.xxh3)

    def abandon(self) -> None:
        """Close and remove the temp file (a write that will not be sealed)."""
        os.close(self.fd)
        self.tmp.unlink(missing_ok=True)


def write_unsealed(path: Path, payload: Payload) -> Unsealed:
    """Copy `payload` into the page cache under a temp name (the disk catches up during `seal`)."""
    if payload.sha256 is None:
        raise ValueError(f"{path.name}: its payload was never hashed")
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        for part in payload.parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view):]  # the GIL is released while the kernel copies
    except BaseException as exc:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, str(tmp)) from exc
        raise
    return Unsealed(path, tmp, fd, payload.size, payload.sha256, payload.xxh3)


def write_payload(path: Path, payload: Payload) -> WrittenFile:
    """Write `payload` durably at `path`: temp file, fsync, rename into place, fsync the directory."""
    return write_unsealed(path, payload).seal()
