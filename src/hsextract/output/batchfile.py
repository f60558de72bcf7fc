"""The batch file contract: one safetensors file per batch, written atomically.

Tensors: `hidden_states` [tokens, n_layers*hidden] (layers concatenated in the order given),
`input_ids` [tokens] int32, `loss_mask` [tokens] uint8 (0/1), `cu_seqlens` [n_samples+1] int64, and with
`--include-last` also `last_hidden_state` [tokens, hidden] (the final normed state).
String metadata: `format_version`, `sample_ids` (JSON list, in order), `layer_ids` (JSON list), `model`,
`hidden_size`, `num_model_layers`, `dtype`, `hsextract_version`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from hsextract.errors import CorruptOutput
from hsextract.output.payload import (
    DATA_CHECKSUM,
    FORMAT_VERSION,
    Payload,
    TensorBytes,
    WrittenFile,
    layout,
    write_payload,
)
from hsextract.output.quant import FP8_ENCODING, SCALE_KEY, dequantize

# safetensors' dtype names of the torch dtypes a batch file may hold
DTYPE_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
               torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}


def build_payload(tensors: dict[str, torch.Tensor], metadata: dict[str, str], hashed: bool = True) -> Payload:
    """The safetensors layout of `tensors` (the layout `safetensors.torch.save` makes: data sorted by element
    size, then dtype, then name; the header padded to 8 bytes) and, if `hashed`, its sha256, without
    serializing a copy."""
    entries = []
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: {tensor.dtype} on {tensor.device} cannot go into a batch file")
        tensor = tensor.detach().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        entries.append(TensorBytes(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape),
                                   data))  # type: ignore[arg-type]  # numpy stubs: ndarray is a Buffer only on 3.12+
    return layout(entries, metadata, hashed)


def write_batch(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> WrittenFile:
    """Lay out, write to a temp file, fsync, rename into place, fsync the directory."""
    return write_payload(path, build_payload(tensors, metadata))


#: how readers check a batch file's bytes (`verify=`): "off" (size only, against the journal), "fast" (the
#: default: xxh3-128 of the whole file against its journal entry, else of its data against the file's own
#: record, else sha256; ~30 GB/s), "full" (sha256 against the journal, as S3 holds it)
VERIFY_MODES = ("off", "fast", "full")


def verify_mode(verify: bool | str) -> str:
    """The mode of a reader's `verify` argument: False -> off, True -> fast, or a mode named."""
    mode = {False: "off", True: "fast"}.get(verify, verify) if isinstance(verify, bool) else verify
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: expected True, False or one of {VERIFY_MODES}")
    return mode


def check_bytes(data, entry: dict | None, where: str, mode: str, repair: str = "") -> None:
    """CorruptOutput naming `where` when a batch file's bytes `data` (any buffer: bytes, a mapped file) are not
    what its journal `entry` recorded (or, read alone, what its own header records of its data). `repair`:
    what to do about it, for the message."""
    import hashlib

    import xxhash

    view = memoryview(data).cast("B")
    size, tail = view.nbytes, f". {repair}" if repair else ""
    if entry is not None and size != entry["bytes"]:
        raise CorruptOutput(f"{where}: {size} bytes, but its journal recorded {entry['bytes']} (truncated or "
                            f"overwritten){tail}")
    if mode == "off":
        return
    if mode == "full" and entry is not None:
        got, want, what = hashlib.sha256(view).hexdigest(), entry["sha256"], "sha256"
    elif mode == "fast" and entry is not None and entry.get("xxh3"):
        got, want, what = xxhash.xxh3_128(view).hexdigest(), entry["xxh3"], "xxh3"
    else:
        try:
            header_len = int.from_bytes(bytes(view[:8]), "little")
            meta = json.loads(bytes(view[8:8 + header_len])).get("__metadata__") or {}
        except (ValueError, UnicodeDecodeError):
            raise CorruptOutput(f"{where}: its safetensors header does not parse (the file is damaged){tail}") \
                from None
        if meta.get(DATA_CHECKSUM):
            got, want = xxhash.xxh3_128(view[8 + header_len:]).hexdigest(), meta[DATA_CHECKSUM]
            what = "xxh3 of its data (the file's own record)"
        elif entry is not None:  # written before files carried checksums of their own
            got, want, what = hashlib.sha256(view).hexdigest(), entry["sha256"], "sha256"
        else:
            return  # a file from before checksums, read alone: nothing to check it against
    if got != want:
        recorded = "its journal recorded" if what in ("sha256", "xxh3") else "its header recorded"
        raise CorruptOutput(f"{where}: checksum mismatch, {what} {got}, but {recorded} {want}: its bytes changed "
                            f"after it was written{tail}")


class BatchFile:
    """Read access to one batch file: metadata and per-sample slices without loading the whole file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handle = safe_open(str(self.path), framework="pt")
        meta = self._handle.metadata() or {}
        if meta.get("format_version") != FORMAT_VERSION:
            version = meta.get("format_version")
            raise ValueError(f"{self.path}: not an hsextract batch file (format_version={version!r})")
        self.metadata = meta
        self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        self.layer_ids: list[int] = json.loads(meta["layer_ids"])
        self.cu_seqlens: list[int] = self._handle.get_tensor("cu_seqlens").tolist()
        self.has_last = "last_hidden_state" in self._handle.keys()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample(self, index: int) -> dict:
        """Sample `index` as the reader contract's record: id, input_ids, loss_mask, hidden_states (bf16 after fp8)."""
        begin, end = self.cu_seqlens[index], self.cu_seqlens[index + 1]
        out: dict = {"id": self.sample_ids[index]}
        names = ["input_ids", "loss_mask", "hidden_states"] + (["last_hidden_state"] if self.has_last else [])
        for name in names:
            out[name] = self._handle.get_slice(name)[begin:end]
        if self.metadata.get("hidden_states_encoding") == FP8_ENCODING:
            out["hidden_states"] = dequantize(out["hidden_states"], self._handle.get_slice(SCALE_KEY)[begin:end])
        return out


class LoadedBatch:
    """A batch file held in memory (an object read from a store): the same `sample()` as BatchFile.
    `copy=False`: the tensors are views of `data` itself (no copy; they live as long as it does). `data` may
    be a uint8 tensor, whose storage the views then share (`mapped`; or `shared_memory`)."""

    def __init__(self, data: bytes | bytearray | torch.Tensor, where: str, copy: bool = True):
        from safetensors.torch import load

        raw = data.numpy() if torch.is_tensor(data) else data
        header_len = int.from_bytes(bytes(raw[:8]), "little")
        header = json.loads(bytes(raw[8:8 + header_len]))
        meta = header.pop("__metadata__", None) or {}
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{where}: not an hsextract batch file (format_version={meta.get('format_version')!r})")
        self.metadata = meta
        self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        self.tensors = load(bytes(raw)) if copy else _views(data, header, 8 + header_len)
        self.has_last = "last_hidden_state" in self.tensors
        self.cu_seqlens: list[int] = self.tensors["cu_seqlens"].tolist()
        self.data = data if torch.is_tensor(data) else None
        self.path: Path | None = None  # the file `data` maps (`mapped`)

    @classmethod
    def mapped(cls, path: Path, where: str | None = None, check=None) -> LoadedBatch:
        """A local file's tensors as views of its pages, mapped copy-on-write (a write stays in this process);
        `check(buffer)` sees the file's bytes first (`check_bytes`)."""
        pages = map_pages(path)
        if check is not None:
            check(pages.numpy())
        batch = cls(pages, where or str(path), copy=False)
        batch.path = Path(path)
        return batch

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample(self, index: int) -> dict:
        """Sample `index`, as `BatchFile.sample`."""
        begin, end = self.cu_seqlens[index], self.cu_seqlens[index + 1]
        out: dict = {"id": self.sample_ids[index]}
        for name in ("input_ids", "loss_mask", "hidden_states", "last_hidden_state"):
            if name in self.tensors:
                out[name] = self.tensors[name][begin:end]
        if self.metadata.get("hidden_states_encoding") == FP8_ENCODING:
            out["hidden_states"] = dequantize(out["hidden_states"], self.tensors[SCALE_KEY][begin:end])
        return out


def shared_memory(size: int) -> torch.Tensor:
    """`size` bytes of shared memory as a uint8 tensor: its views cross to another process (a DataLoader's)
    as a handle of that memory, not as bytes."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))


def map_pages(path: str | Path) -> torch.Tensor:
    """A file's bytes as a uint8 tensor over its pages, mapped copy-on-write (a write stays in this process),
    the kernel asked to read them ahead."""
    import mmap

    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(pages, dtype=torch.uint8)


_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _views(data, header: dict, base: int) -> dict[str, torch.Tensor]:
    """The tensors a safetensors header describes, as views of `data` (a uint8 tensor, or a buffer: bytes are
    read-only, never write)."""
    import warnings

    tensors = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.frombuffer warns that bytes are not writable
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            dtype = _BY_NAME[entry["dtype"]]
            if torch.is_tensor(data):
                flat = data[base + begin:base + end]
            else:
                flat = (torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=base + begin)
                        if end > begin else torch.empty(0, dtype=torch.uint8))
            tensors[name] = flat.view(dtype).reshape(entry["shape"])
    return tensors
