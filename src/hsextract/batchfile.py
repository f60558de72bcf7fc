"""The batch file contract: one safetensors file per batch, written atomically.

Tensors: `hidden_states` [tokens, n_layers*hidden] (layers concatenated in the order given),
`input_ids` [tokens] int32, `loss_mask` [tokens] uint8 (0/1), `cu_seqlens` [n_samples+1] int64, and with
`--include-last` also `last_hidden_state` [tokens, hidden] (the final normed state).
String metadata: `format_version`, `sample_ids` (JSON list, in order), `layer_ids` (JSON list), `model`,
`hidden_size`, `num_model_layers`, `dtype`, `hsextract_version`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from .quant import FP8_ENCODING, SCALE_KEY, dequantize

FORMAT_VERSION = "1"


@dataclass(frozen=True)
class WrittenFile:
    name: str
    bytes: int
    sha256: str


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_batch(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> WrittenFile:
    """Serialize, write to a temp file, fsync, rename into place, fsync the directory."""
    return write_payload(path, *serialize_batch(tensors, metadata))


def serialize_batch(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, str]:
    """The file's bytes and their sha256 (CPU work a pipeline can overlap with the previous file's write)."""
    payload = save(tensors, metadata={"format_version": FORMAT_VERSION, **metadata})
    return payload, hashlib.sha256(payload).hexdigest()


def write_payload(path: Path, payload: bytes, digest: str) -> WrittenFile:
    """Write `payload` durably at `path`: temp file, fsync, rename into place, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return WrittenFile(path.name, len(payload), digest)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class BatchFile:
    """Read access to one batch file: metadata and per-sample slices without loading the whole file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handle = safe_open(str(self.path), framework="pt")
        meta = self._handle.metadata() or {}
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{self.path}: not an hsextract batch file (format_version={meta.get('format_version')!r})")
        self.metadata = meta
        self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        self.layer_ids: list[int] = json.loads(meta["layer_ids"])
        self.cu_seqlens: list[int] = self._handle.get_tensor("cu_seqlens").tolist()
        self.has_last = "last_hidden_state" in self._handle.keys()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample(self, index: int) -> dict:
        begin, end = self.cu_seqlens[index], self.cu_seqlens[index + 1]
        out = {"id": self.sample_ids[index]}
        names = ["input_ids", "loss_mask", "hidden_states"] + (["last_hidden_state"] if self.has_last else [])
        for name in names:
            out[name] = self._handle.get_slice(name)[begin:end]
        if self.metadata.get("hidden_states_encoding") == FP8_ENCODING:
            out["hidden_states"] = dequantize(out["hidden_states"], self._handle.get_slice(SCALE_KEY)[begin:end])
        return out


class LoadedBatch:
    """A batch file held in memory (an object read from a store): the same `sample()` as BatchFile."""

    def __init__(self, data: bytes, where: str):
        from safetensors.torch import load

        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{where}: not an hsextract batch file (format_version={meta.get('format_version')!r})")
        self.metadata = meta
        self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        self.tensors = load(data)
        self.cu_seqlens: list[int] = self.tensors["cu_seqlens"].tolist()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample(self, index: int) -> dict:
        begin, end = self.cu_seqlens[index], self.cu_seqlens[index + 1]
        out = {"id": self.sample_ids[index]}
        for name in ("input_ids", "loss_mask", "hidden_states", "last_hidden_state"):
            if name in self.tensors:
                out[name] = self.tensors[name][begin:end]
        if self.metadata.get("hidden_states_encoding") == FP8_ENCODING:
            out["hidden_states"] = dequantize(out["hidden_states"], self.tensors[SCALE_KEY][begin:end])
        return out
