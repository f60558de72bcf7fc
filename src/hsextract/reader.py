"""The reader contract: every sample of an extraction exactly once, as the per-sample record trainers load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from .batchfile import BatchFile, sha256_file
from .journal import scan_output


def _local(path_or_uri: str | Path) -> Path:
    text = str(path_or_uri)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if "://" in text:
        raise ValueError(f"{text!r}: only local paths and file:// URIs can be read by this version")
    return Path(text)


def sample_index(path_or_uri: str | Path, verify: bool = False) -> list[tuple[Path, int]]:
    """(batch file, position) of every sample, first journaled copy of each id only, in journal order.

    A directory is read through its journals (files they do not name do not exist); a single batch file is
    read whole. With `verify`, each file's sha256 is checked against its journal entry first.
    """
    root = _local(path_or_uri)
    if root.is_file():
        return [(root, i) for i in range(len(BatchFile(root)))]
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such extraction output")
    state = scan_output(root)
    index = []
    for shard, entry in state.files:
        path = root / shard / entry["file"]
        if verify and sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: checksum does not match its journal entry")
        for position, sample_id in enumerate(entry["ids"]):
            if state.written[sample_id] == (shard, entry["file"]):
                index.append((path, position))
    return index


def describe_output(path_or_uri: str | Path, verify: bool = False) -> dict:
    """Samples, tokens, files and bytes an output holds (each sample counted once)."""
    root = _local(path_or_uri)
    index = sample_index(root, verify)
    state = scan_output(root)
    tokens = sum(e["tokens"] for _, e in state.files)
    return {"out": str(root), "samples": len(index), "files": len(state.files),
            "bytes": sum(e["bytes"] for _, e in state.files), "tokens_in_files": tokens,
            "skipped": len(state.skipped), "shards_done": sorted(state.done_shards), "verified": verify}


def read_samples(path_or_uri: str | Path, verify: bool = False) -> Iterator[dict]:
    """Yield `{"id", "input_ids" [T], "loss_mask" [T], "hidden_states" [T, n_layers*hidden]}` per sample
    (plus `last_hidden_state` [T, hidden] when extracted with --include-last), each id exactly once."""
    current: BatchFile | None = None
    for path, position in sample_index(path_or_uri, verify):
        if current is None or current.path != path:
            current = BatchFile(path)
        yield current.sample(position)


class HiddenStatesDataset(torch.utils.data.Dataset):
    """Map-style torch Dataset over the same records as `read_samples`, opening files lazily."""

    def __init__(self, path_or_uri: str | Path, verify: bool = False):
        self.index = sample_index(path_or_uri, verify)
        self._open: dict[Path, BatchFile] = {}

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: int) -> dict:
        path, position = self.index[item]
        handle = self._open.get(path)
        if handle is None:
            if len(self._open) >= 8:
                self._open.pop(next(iter(self._open)))
            handle = self._open[path] = BatchFile(path)
        return handle.sample(position)
