"""Where an extraction's output lives: one interface over a local directory and an S3 prefix.

`open_store(uri)` is the one place that tells a local output (a path, or `file://...`) from `s3://bucket/prefix`;
everything else (the worker's resume and upload, the reader, the flow's planning, reconcile) works on a
`Store` and does not ask which. Keys are relative to the output's root and `/`-separated
(`shard-00000-of-00004/batch-000001.safetensors`). `scan(store)` reads every shard journal in it and
merges them (hsextract.journal): what is written, skipped, lost and done, by sample id and by shard.

No torch here, and boto3 is imported only when an S3 store is made: the orchestrator uses this module too.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..journal import JOURNAL_NAME, OutputState, merge_journals, parse_entries
from .base import FILE_MODE, NoSuchBucket, Store, StoredObject, StoreError
from .local import LocalStore, fsync_dir, make_dirs, sha256_file, write_atomic
from .s3 import S3Store, s3_client, split_uri

__all__ = ["FILE_MODE", "LocalStore", "NoSuchBucket", "OutputState", "S3Store", "Store", "StoreError", "StoredObject",
           "fsync_dir", "in_s3", "journal_keys", "local_dir", "make_dirs", "open_store", "s3_client", "scan",
           "sha256_file", "split_uri", "write_atomic"]


def in_s3(uri: str | Path) -> bool:
    """Whether `uri` names a place in S3 (`s3://bucket/...`): the question `local_dir` and `open_store` answer too."""
    return str(uri).startswith("s3://")


def local_dir(uri: str | Path) -> Path | None:
    """The local directory an output's URI names (a path or `file://...`), or None for `s3://`: the one place,
    with `open_store`, that tells the schemes apart. ValueError for any other scheme."""
    text = str(uri)
    if in_s3(text):
        return None
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"{text!r}: expected a local path, file:// or s3:// URI")
    return Path(text.removeprefix("file://"))


def open_store(uri: str | Path, client=None) -> Store:
    """The store of an output: `s3://bucket/prefix`, or a local directory given as a path or `file://` URI
    (made when something is first written there). For S3, `client` is a boto3 client or a function that
    makes one (called only then); without it, boto3's default credential chain and $AWS_ENDPOINT_URL."""
    local = local_dir(uri)
    if local is None:
        return S3Store(str(uri), client() if callable(client) else client)
    return LocalStore(local)


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
