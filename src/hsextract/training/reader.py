"""The reader contract: every sample of an extraction exactly once, as the per-sample record trainers load.

An output is read through its journals (`hsextract.output.journal.scan`: files they do not name do not exist), from
any store: a local directory is read in place (each file opened lazily, samples sliced from it), an
`s3://` prefix is streamed object by object, the next one downloading while one is read.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hsextract.errors import CorruptOutput
from hsextract.output.batchfile import BatchFile, LoadedBatch, check_bytes, map_pages, shared_memory, verify_mode
from hsextract.output.journal import OutputState, journal_keys, scan
from hsextract.store import Store, open_store


def first_copies(state: OutputState) -> list[tuple[str, dict]]:
    """The journaled files holding the first copy of at least one sample, in journal order."""
    return [(shard, entry) for shard, entry in state.files
            if any(state.written[i] == (shard, entry["file"]) for i in entry["ids"])]


def scan_output(store: Store, checksums: bool = False) -> OutputState:
    """`scan`, refusing a place that holds no journal and is not a local directory (an empty one is an output
    with nothing in it yet)."""
    state = scan(store, checksums)
    root = store.local_path("")
    if not journal_keys(state.objects.values()) and not (root is not None and root.is_dir()):
        raise FileNotFoundError(f"{store.uri}: no shard journals there (not an extraction output)")
    return state


def repair_hint(store: Store, entry: dict) -> str:
    """What to do about a corrupt batch file, for the message."""
    return (f"`hsextract fsck {store.uri} --repair` retracts it, and the next run of its shard redoes its "
            f"{len(entry.get('ids') or ())} sample(s)")


def read_batches(store: Store, files: list[tuple[str, dict]], verify: bool | str, ahead: int = 1,
                 views: bool = False, shared: bool = False,
                 checked: dict[str, tuple] | None = None) -> Iterator[tuple[str, dict, BatchFile | LoadedBatch]]:
    """(shard dir, file entry, batch) per file, in order. Local files are opened in place (checked
    `hash_threads()` files ahead, at least `ahead`); remote ones are downloaded `ahead` files ahead. Each file's
    size and checksum are checked against its journal entry first (`verify`: `batchfile.VERIFY_MODES`;
    CorruptOutput naming the file). `views`: their tensors are views of the bytes downloaded, not copies: never
    write to them. `shared`: `LoadedBatch`es whose tensors can cross to another process without a copy (a local
    file's pages mapped, a download in shared memory). `checked`: the local files this reader has checked before
    (path -> `identity`), kept up to date here: a file unchanged since is not hashed again (its size still is
    checked), one whose identity changed is."""
    mode = verify_mode(verify)
    if store.local_path("") is not None and mode != "off" and not shared:
        ahead = max(ahead, hash_threads())
    known = {} if checked is None else checked

    def fetch(item):
        shard, entry = item
        key = f"{shard}/{entry['file']}"
        path = store.local_path(key)
        if path is not None:
            if not path.is_file():
                raise CorruptOutput(f"{store.where(key)}: journaled, but not there. {repair_hint(store, entry)}")
            seen = identity(path)  # before its bytes are read
            file_mode = "off" if known.get(str(path)) == seen else mode

            def check(data) -> None:
                check_bytes(data, entry, store.where(key), file_mode, repair_hint(store, entry))
                if file_mode != "off":
                    known[str(path)] = seen

            if shared:
                return LoadedBatch.mapped(path, store.where(key), check)
            check(map_pages(path).numpy())
            return BatchFile(path)
        if shared:  # downloaded straight into shared memory
            data = shared_memory(entry["bytes"])
            size = store.read_into(key, raw := data.numpy())
            raw = raw[:size]
        else:
            raw = data = store.read(key)
        check_bytes(raw, entry, store.where(key), mode, repair_hint(store, entry))
        return LoadedBatch(data, store.where(key), copy=not (views or shared))

    with ThreadPoolExecutor(max(1, ahead)) as pool:
        coming = deque(pool.submit(fetch, item) for item in files[:max(1, ahead)])
        for n, (shard, entry) in enumerate(files):
            batch = coming.popleft().result()
            if n + len(coming) + 1 < len(files):
                coming.append(pool.submit(fetch, files[n + len(coming) + 1]))
            yield shard, entry, batch


def identity(path: Path) -> tuple:
    """What changes when a file's bytes may have: device, inode, size, modification and change times (a write,
    a truncation, a rename over it, a `touch`)."""
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def hash_threads() -> int:
    """How many local files one reading process checks at once: a core each, one left to the consumer, at most
    8. A file's check is one thread's hash of every byte (~8 GB/s on a cloud host's core) while one process's
    consumer copies samples out at 24-42 GB/s on 16 cores (`benchmarks/hash_paths.py`); a mapped file ahead holds
    nothing but the page cache, so local reads look further ahead than `ahead` downloads would. In a DataLoader
    worker its siblings are the other cores' checks: `ahead` stays as given there."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, max(1, cores - 1))


def read_samples(path_or_uri: str | Path, verify: bool | str = True, client=None) -> Iterator[dict]:
    """Yield `{"id", "input_ids" [T], "loss_mask" [T], "hidden_states" [T, n_layers*hidden]}` per sample
    (plus `last_hidden_state` [T, hidden] when extracted with --include-last), each id exactly once (its first
    journaled copy). Each file's bytes are checked before its samples are given out (`verify`: True, the
    default, a fast checksum; "full": sha256 against the journal; False: its size only); a file that differs
    raises CorruptOutput naming it. An output holding more than one recipe raises before any sample.

    `path_or_uri`: an output directory (path or file://), one batch file, or `s3://bucket/prefix` (streamed,
    through `client`, else boto3's default credential chain and $AWS_ENDPOINT_URL)."""
    for batch, position in sample_positions(path_or_uri, verify, client):
        yield batch.sample(position)


def sample_positions(path_or_uri: str | Path, verify: bool | str = True, client=None,
                     mixed: bool = False) -> Iterator[tuple[BatchFile | LoadedBatch, int]]:
    """(batch, position) of every sample `read_samples` yields, in the same order: the batch (a `BatchFile` or
    `LoadedBatch`: its `metadata` says which layers, model and dtype) is held only while its samples are read.
    `mixed`: read an output of several recipes anyway (fsck, an export told so)."""
    store = open_store(path_or_uri, client)
    single = store.local_path("")
    if single is not None and single.is_file():
        yield from _single_file(single, verify_mode(verify))
        return
    state = scan_output(store)
    if not mixed:
        refuse_mixed(state, store.uri)
    for shard, entry, batch in read_batches(store, first_copies(state), verify):
        yield from ((batch, position) for position in first_positions(state, shard, entry, batch))


def _single_file(path: Path, mode: str) -> Iterator[tuple[BatchFile | LoadedBatch, int]]:
    """One batch file read alone: its data checked against its own header's record."""
    from safetensors import SafetensorError

    check_bytes(map_pages(path).numpy(), None, str(path), mode)
    try:
        batch = BatchFile(path)
    except (SafetensorError, OSError) as exc:
        raise CorruptOutput(f"{path}: not a readable batch file ({exc})") from None
    yield from ((batch, i) for i in range(len(batch)))


def refuse_mixed(state: OutputState, where: str) -> None:
    """CorruptOutput when the output's journals record more than one recipe: its samples are not one dataset."""
    prints = state.fingerprints()
    if len(prints) > 1:
        raise CorruptOutput(f"{where}: holds {len(prints)} recipes (" + "; ".join(
            f"{fp} in {', '.join(dirs[:3])}" + (" ..." if len(dirs) > 3 else "") for fp, dirs in prints.items())
            + "): its samples are not one dataset (`hsextract fsck` lists which files are which)")


def first_positions(state: OutputState, shard: str, entry: dict, batch) -> list[int]:
    """Positions in `batch` (the file `entry` of `shard`) of the samples whose first copy it holds."""
    return [n for n, sample_id in enumerate(batch.sample_ids) if state.written[sample_id] == (shard, entry["file"])]


def sample_index(path_or_uri: str | Path, verify: bool | str = False) -> list[tuple[Path, int]]:
    """(batch file, position) of every sample of a local output, first journaled copy of each id only, in
    journal order (one batch file: all of its samples). With `verify`, each file is checked now
    (`batchfile.VERIFY_MODES`); `HiddenStatesDataset` checks each as it first opens it instead."""
    return _index(path_or_uri, verify)[0]


def _index(path_or_uri: str | Path, verify: bool | str) -> tuple[list[tuple[Path, int]], dict[Path, tuple]]:
    """`sample_index`, and {file: (its journal entry, where, repair hint)}."""
    mode = verify_mode(verify)
    store = open_store(path_or_uri)
    root = store.local_path("")
    if root is None:
        raise ValueError(f"{path_or_uri}: s3:// outputs are read as a stream: use read_samples (or describe_output)")
    if root.is_file():
        if mode != "off":
            check_bytes(map_pages(root).numpy(), None, str(root), mode)
        return [(root, i) for i in range(len(BatchFile(root)))], {}
    state = scan_output(store)
    refuse_mixed(state, store.uri)
    index, entries = [], {}
    for shard, entry in first_copies(state):
        key = f"{shard}/{entry['file']}"
        path = store.local_path(key)
        assert path is not None  # a local output: every key has a path
        entries[path] = (entry, store.where(key), repair_hint(store, entry))
        if mode != "off":
            check_bytes(map_pages(path).numpy(), entry, store.where(key), mode, repair_hint(store, entry))
        index += [(path, n) for n, i in enumerate(entry["ids"]) if state.written[i] == (shard, entry["file"])]
    return index, entries


def describe_output(path_or_uri: str | Path, verify: bool = False, client=None) -> dict:
    """Samples, tokens, files and bytes an output holds (each sample counted once), from its journals.
    `verify`: every journaled file must be stored with its journal's sha256 (each file hashed locally; on S3
    the sha256 stored with each object, which S3 checked against the bytes when they arrived)."""
    store = open_store(path_or_uri, client)
    state = scan_output(store, checksums=verify)
    if verify:
        for shard, entry in state.files:
            key = f"{shard}/{entry['file']}"
            stored = state.objects.get(key)
            if stored is None or stored.sha256 != entry["sha256"]:
                raise ValueError(f"{store.where(key)}: " + ("not stored" if stored is None else
                                 "checksum does not match its journal entry"))
    root = store.local_path("")
    return {"out": str(root) if root is not None else store.uri, "samples": len(state.written),
            "files": len(state.files), "bytes": sum(e["bytes"] for _, e in state.files),
            "tokens_in_files": sum(e["tokens"] for _, e in state.files), "skipped": len(state.skipped),
            "shards_done": sorted(state.done_shards), "verified": verify}


class HiddenStatesDataset(torch.utils.data.Dataset):
    """Map-style torch Dataset over the same records as `read_samples` (a local output), opening files lazily;
    each file's bytes are checked when it is first opened (`verify`, as `read_samples`'s; "full" checks every
    file before the first sample)."""

    def __init__(self, path_or_uri: str | Path, verify: bool | str = True):
        self.mode = verify_mode(verify)
        self.index, self._entries = _index(path_or_uri, verify if self.mode == "full" else False)
        self._checked: set[Path] = set() if self.mode == "fast" else set(self._entries)
        self._open: dict[Path, BatchFile] = {}

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: int) -> dict:
        path, position = self.index[item]
        handle = self._open.get(path)
        if handle is None:
            if len(self._open) >= 8:
                self._open.pop(next(iter(self._open)))
            if path not in self._checked and path in self._entries:
                entry, where, hint = self._entries[path]
                check_bytes(map_pages(path).numpy(), entry, where, self.mode, hint)
                self._checked.add(path)
            handle = self._open[path] = BatchFile(path)
        return handle.sample(position)
