"""Where an extraction's output lives: one interface over a local directory and an S3 prefix.

`open_store(uri)` is the one place that tells a local output (a path, or `file://...`) from `s3://bucket/prefix`;
everything else (the worker's resume and upload, the reader, the flow's planning, reconcile) works on a
`Store` and does not ask which. Keys are relative to the output's root and `/`-separated
(`shard-00000-of-00004/batch-000001.safetensors`). What the objects mean (journals, batch files) is the
output format's (`hsextract.output`): nothing here reads them.

No torch here, and boto3 is imported only when an S3 store is made: the orchestrator uses this module too.
"""

from __future__ import annotations

from pathlib import Path

from hsextract.store.base import FILE_MODE, NoSuchBucket, Store, StoredObject, StoreError
from hsextract.store.local import LocalStore, fsync_dir, make_dirs, sha256_file, write_atomic
from hsextract.store.s3 import S3Store, s3_client, split_uri

__all__ = ["FILE_MODE", "LocalStore", "NoSuchBucket", "S3Store", "Store", "StoreError", "StoredObject", "fsync_dir",
           "in_s3", "local_dir", "make_dirs", "open_store", "s3_client", "sha256_file", "split_uri", "write_atomic"]


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
