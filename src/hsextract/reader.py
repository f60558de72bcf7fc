"""The reader contract: every sample of an extraction exactly once, as the per-sample record trainers load."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch

from .batchfile import BatchFile, LoadedBatch, sha256_file
from .journal import scan_output


def _local(path_or_uri: str | Path) -> Path:
    text = str(path_or_uri)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if text.startswith("s3://"):
        raise ValueError(f"{text!r}: s3:// outputs are read as a stream: use read_samples (or describe_output)")
    if "://" in text:
        raise ValueError(f"{text!r}: expected a local path, file:// or s3:// URI")
    return Path(text)


def _s3_state(uri: str, client):
    """Merged journals mirrored under an s3:// output (they name only objects verified in the store)."""
    from .journal import merge_journals, parse_entries
    from .upload import split_uri, store_journals

    bucket, prefix = split_uri(uri)
    base = f"{prefix}/" if prefix else ""
    journals = []
    for obj in store_journals(client, uri):
        key = obj["Key"]
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        journals.append((key[len(base):].split("/")[0], list(parse_entries(data, f"s3://{bucket}/{key}"))))
    if not journals:
        raise FileNotFoundError(f"{uri}: no shard journals under this prefix (not an extraction output)")
    return bucket, base, merge_journals(journals)


def _stream_s3(uri: str, verify: bool, client) -> Iterator[dict]:
    """One object in memory at a time (and the next one downloading): never the whole output."""
    from concurrent.futures import ThreadPoolExecutor

    from .upload import s3_client

    client = client or s3_client()
    bucket, base, state = _s3_state(uri, client)
    wanted = [(shard, entry) for shard, entry in state.files
              if any(state.written[i] == (shard, entry["file"]) for i in entry["ids"])]

    def fetch(item):
        shard, entry = item
        key = f"{base}{shard}/{entry['file']}"
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        if len(data) != entry["bytes"] or (verify and hashlib.sha256(data).hexdigest() != entry["sha256"]):
            raise ValueError(f"s3://{bucket}/{key}: {len(data)} bytes / checksum do not match its journal entry")
        return key, data

    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(fetch, wanted[0]) if wanted else None
        for n, (shard, entry) in enumerate(wanted):
            key, data = ahead.result()
            ahead = pool.submit(fetch, wanted[n + 1]) if n + 1 < len(wanted) else None
            batch = LoadedBatch(data, f"s3://{bucket}/{key}")
            for position, sample_id in enumerate(batch.sample_ids):
                if state.written[sample_id] == (shard, entry["file"]):
                    yield batch.sample(position)


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


def describe_output(path_or_uri: str | Path, verify: bool = False, client=None) -> dict:
    """Samples, tokens, files and bytes an output holds (each sample counted once). For s3:// it reads the
    mirrored journals only (`verify` there is the reconcile's job)."""
    if str(path_or_uri).startswith("s3://"):
        from .upload import s3_client

        _, _, state = _s3_state(str(path_or_uri), client or s3_client())
        return {"out": str(path_or_uri), "samples": len(state.written), "files": len(state.files),
                "bytes": sum(e["bytes"] for _, e in state.files),
                "tokens_in_files": sum(e["tokens"] for _, e in state.files), "skipped": len(state.skipped),
                "shards_done": sorted(state.done_shards), "verified": False}
    root = _local(path_or_uri)
    index = sample_index(root, verify)
    state = scan_output(root)
    tokens = sum(e["tokens"] for _, e in state.files)
    return {"out": str(root), "samples": len(index), "files": len(state.files),
            "bytes": sum(e["bytes"] for _, e in state.files), "tokens_in_files": tokens,
            "skipped": len(state.skipped), "shards_done": sorted(state.done_shards), "verified": verify}


def read_samples(path_or_uri: str | Path, verify: bool = False, client=None) -> Iterator[dict]:
    """Yield `{"id", "input_ids" [T], "loss_mask" [T], "hidden_states" [T, n_layers*hidden]}` per sample
    (plus `last_hidden_state` [T, hidden] when extracted with --include-last), each id exactly once.

    `s3://bucket/prefix` is streamed object by object (boto3's default credential chain and
    $AWS_ENDPOINT_URL, or `client`); a local path or file:// is read in place."""
    if str(path_or_uri).startswith("s3://"):
        yield from _stream_s3(str(path_or_uri), verify, client)
        return
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
