"""Reconcile what landed in the output against the dataset, and seal a complete run.

`reconcile_output` reads every shard journal and lists every stored object, then accounts for each of the
dataset's sample ids: done (in a stored object whose size and checksum match its journal entry), skipped
(by reason), or missing. Samples stored twice resolve to one copy in the index. Only when nothing is
missing does it write the index (`_index.jsonl`: one line per sample, id -> file, row, token offsets) and
claim `_SUCCESS` with a create-only write, so two reconcilers cannot both seal one run.

Pure Python over a `Store` (local directory here; the S3 store implements the same three calls).
No torch: the dataset's ids come from `hsextract.records`, the same code the worker assigns ids with.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from hsextract.journal import JOURNAL_NAME, parse_entries
from hsextract.records import iter_ids
from hsextract.upload import split_uri
from hsextract.sharding import shard_of

INDEX_NAME = "_index.jsonl"
SUCCESS_NAME = "_SUCCESS"
FILE_MODE = 0o640  # like the workers' files: the group may read, others may not


@dataclass(frozen=True)
class StoredObject:
    key: str                  # relative to the output root, e.g. shard-00000-of-00004/batch-000001.safetensors
    size: int
    sha256: str | None = None  # hex, when the store knows it (S3 ChecksumSHA256, or a local verify)


class Store(ABC):
    """Where a run's output lives: list objects, read small ones, create one only if it does not exist."""

    @abstractmethod
    def list(self) -> Iterator[StoredObject]:
        """Every object under the output root (paginated by the store as needed)."""

    @abstractmethod
    def read(self, key: str) -> bytes:
        ...

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if absent; False if it already exists (someone else claimed it)."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        ...

    def append(self, key: str, data: bytes) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot append to {key}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class LocalStore(Store):
    """A `file://` output directory: a real destination, not a mock."""

    def __init__(self, root: str | Path, verify: bool = False):
        self.root = Path(root)
        self.verify = verify

    def list(self) -> Iterator[StoredObject]:
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                yield StoredObject(key, path.stat().st_size, sha256_file(path) if self.verify and
                                   key.endswith(".safetensors") else None)

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def create(self, key: str, data: bytes) -> bool:
        try:
            fd = os.open(self.root / key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return True

    def write(self, key: str, data: bytes) -> None:
        target = self.root / key
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)

    def append(self, key: str, data: bytes) -> None:
        fd = os.open(self.root / key, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


class S3Store(Store):
    """`s3://bucket/prefix` through boto3 (any S3-compatible endpoint). `_SUCCESS` uses If-None-Match."""

    def __init__(self, uri: str, client=None, verify: bool = False, **client_kwargs):
        self.bucket, self.prefix = split_uri(uri)
        if client is None:
            import boto3

            client = boto3.client("s3", **client_kwargs)
        self.client = client
        self.verify = verify

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def list(self) -> Iterator[StoredObject]:
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
        objects = [StoredObject(o["Key"][len(base):], o["Size"]) for page in pages for o in page.get("Contents", [])]
        if not self.verify:
            return iter(objects)
        from concurrent.futures import ThreadPoolExecutor

        def checked(obj: StoredObject) -> StoredObject:
            if not obj.key.endswith(".safetensors"):
                return obj
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(obj.key))
            return StoredObject(obj.key, obj.size, head.get("Metadata", {}).get("sha256"))

        with ThreadPoolExecutor(32) as pool:
            return iter(list(pool.map(checked, objects)))

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def create(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*",
                                   ChecksumAlgorithm="SHA256")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ChecksumAlgorithm="SHA256")

    def append(self, key: str, data: bytes, attempts: int = 5) -> None:
        """Read, extend, put back only if unchanged since the read (If-Match on the ETag); retried on a race."""
        from botocore.exceptions import ClientError

        for _ in range(attempts):
            got = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            body = got["Body"].read()
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body + data, IfMatch=got["ETag"],
                                       ChecksumAlgorithm="SHA256")
                return
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise
        raise RuntimeError(f"s3://{self.bucket}/{self._key(key)}: changed under every one of {attempts} appends")


@dataclass
class ShardReport:
    expected: int = 0
    done: int = 0
    missing: int = 0
    skipped: Counter = field(default_factory=Counter)

    def row(self) -> dict:
        return {"expected": self.expected, "done": self.done, "missing": self.missing,
                "skipped": sum(self.skipped.values())}


@dataclass
class Report:
    num_shards: int
    expected: int = 0
    done: int = 0
    duplicated: int = 0                  # samples with more than one good stored copy (index keeps one)
    skipped: Counter = field(default_factory=Counter)  # reason -> samples
    missing_ids: dict[int, list[str]] = field(default_factory=dict)  # shard -> ids to re-run
    missing_objects: list[str] = field(default_factory=list)  # journaled but not stored
    corrupt_objects: list[str] = field(default_factory=list)  # stored, but size/checksum differ from journal
    unjournaled_objects: int = 0         # batch files no journal names (half-done writes; ignored)
    shards: dict[int, ShardReport] = field(default_factory=dict)
    sealed: bool = False                 # this reconcile wrote _SUCCESS
    already_sealed: bool = False         # _SUCCESS existed (another reconciler, or an earlier run)
    seconds: float = 0.0

    @property
    def missing(self) -> int:
        return sum(len(v) for v in self.missing_ids.values())

    @property
    def complete(self) -> bool:
        return self.missing == 0

    @property
    def shards_to_rerun(self) -> list[int]:
        return sorted(s for s, ids in self.missing_ids.items() if ids)

    def summary(self) -> dict:
        return {"num_shards": self.num_shards, "expected": self.expected, "done": self.done,
                "missing": self.missing, "duplicated": self.duplicated, "skipped": dict(self.skipped),
                "missing_objects": len(self.missing_objects), "corrupt_objects": len(self.corrupt_objects),
                "unjournaled_objects": self.unjournaled_objects, "shards_to_rerun": self.shards_to_rerun,
                "complete": self.complete, "sealed": self.sealed, "already_sealed": self.already_sealed,
                "seconds": round(self.seconds, 3)}

    def markdown(self) -> str:
        lines = [f"**{'complete' if self.complete else 'INCOMPLETE'}**: {self.done:,} of {self.expected:,} "
                 f"samples stored, {sum(self.skipped.values()):,} skipped, {self.missing:,} missing, "
                 f"{self.duplicated:,} duplicated (one copy indexed)."]
        if self.skipped:
            lines.append("Skipped by reason: " + ", ".join(f"`{r}` {n:,}" for r, n in self.skipped.most_common()))
        for title, items in (("Missing objects", self.missing_objects), ("Corrupt objects", self.corrupt_objects)):
            if items:
                lines.append(f"{title} ({len(items)}): " + ", ".join(f"`{k}`" for k in items[:20])
                             + (" ..." if len(items) > 20 else ""))
        if self.shards_to_rerun:
            lines.append(f"Shards to re-run: {self.shards_to_rerun}")
        lines.append(f"{'_SUCCESS written' if self.sealed else '_SUCCESS already present' if self.already_sealed else 'not sealed'}"
                     f"; reconciled in {self.seconds:.2f}s.")
        return "\n\n".join(lines)

    def table(self) -> list[dict]:
        return [{"shard": s, **r.row()} for s, r in sorted(self.shards.items())]


def read_journals(store: Store, listing: Iterable[StoredObject]) -> list[tuple[str, list[dict]]]:
    """(shard dir, entries) for every journal in the listing; a torn final line is left out."""
    out = []
    for obj in listing:
        if obj.key.endswith("/" + JOURNAL_NAME) and obj.key.count("/") == 1:
            out.append((obj.key.split("/")[0], list(parse_entries(store.read(obj.key), obj.key))))
    return sorted(out)


def reconcile_output(store: Store, dataset_ids: Iterable[str], num_shards: int, seal: bool = True,
                     retract: bool = False) -> Report:
    """Account for every dataset id; write the index and claim `_SUCCESS` when nothing is missing.

    `retract`: append a `lost` entry to the journal of every missing or corrupt object, so the next run
    of its shard recomputes those samples instead of trusting the journal."""
    started = time.monotonic()
    report = Report(num_shards)
    listing = list(store.list())
    stored = {o.key: o for o in listing}
    journals = read_journals(store, listing)
    journaled: set[str] = set()
    where: dict[str, tuple[str, int, int, int]] = {}  # id -> (key, row, start, end): first good copy wins
    copies: Counter = Counter()
    skipped: dict[str, str] = {}
    lost: list[tuple[str, str, str]] = []  # (shard dir, file, why)
    for shard_dir, entries in journals:
        retracted = {e["file"] for e in entries if e.get("kind") == "lost"}
        for entry in entries:
            kind = entry.get("kind")
            if kind == "skip" and entry.get("reason") != "duplicate_id":
                skipped.setdefault(entry["id"], entry["reason"])
            if kind != "file":
                continue
            key = f"{shard_dir}/{entry['file']}"
            journaled.add(key)
            if entry["file"] in retracted:
                continue
            obj = stored.get(key)
            if obj is None:
                report.missing_objects.append(key)
                lost.append((shard_dir, entry["file"], "not in the store"))
                continue
            if obj.size != entry["bytes"] or (obj.sha256 is not None and obj.sha256 != entry["sha256"]):
                report.corrupt_objects.append(key)
                lost.append((shard_dir, entry["file"], f"stored size {obj.size} / sha256 {obj.sha256} differ "
                                                       f"from the journal's {entry['bytes']} / {entry['sha256']}"))
                continue
            lengths = entry.get("lengths") or [None] * len(entry["ids"])
            start = 0
            for row, (sample_id, length) in enumerate(zip(entry["ids"], lengths)):
                copies[sample_id] += 1
                end = None if length is None or start is None else start + length
                where.setdefault(sample_id, (key, row, start, end))
                start = end
    if retract:
        for shard_dir, name, why in lost:
            line = json.dumps({"kind": "lost", "file": name, "why": why, "time": round(time.time(), 3)},
                              separators=(",", ":"))
            store.append(f"{shard_dir}/{JOURNAL_NAME}", (line + "\n").encode())
    report.unjournaled_objects = sum(1 for k in stored if k.endswith(".safetensors") and k not in journaled)
    report.duplicated = sum(1 for n in copies.values() if n > 1)

    seen: set[str] = set()
    missing: dict[int, list[str]] = defaultdict(list)
    for sample_id in dataset_ids:
        if sample_id in seen:
            continue  # a repeated id in the dataset is one sample (the worker skips the repeats)
        seen.add(sample_id)
        shard = shard_of(sample_id, num_shards)
        row = report.shards.setdefault(shard, ShardReport())
        row.expected += 1
        if sample_id in where:
            row.done += 1
        elif sample_id in skipped:
            row.skipped[skipped[sample_id]] += 1
            report.skipped[skipped[sample_id]] += 1
        else:
            row.missing += 1
            missing[shard].append(sample_id)
    report.expected = len(seen)
    report.done = sum(r.done for r in report.shards.values())
    report.missing_ids = dict(missing)
    if report.complete and seal:
        if SUCCESS_NAME in stored:
            report.already_sealed = True
        else:
            lines = (json.dumps({"id": i, "file": k, "row": r, "start": s, "end": e}, separators=(",", ":"))
                     for i, (k, r, s, e) in where.items() if i in seen)
            store.write(INDEX_NAME, ("\n".join(lines) + "\n").encode())
            report.seconds = time.monotonic() - started
            marker = json.dumps({"time": round(time.time(), 3), "index": INDEX_NAME, **report.summary(),
                                 "sealed": True}).encode()
            report.sealed = store.create(SUCCESS_NAME, marker)
            report.already_sealed = not report.sealed
    report.seconds = time.monotonic() - started
    return report


def dataset_ids(path: str | Path) -> Iterator[str]:
    for sample_id, _ in iter_ids(path):
        yield sample_id


def _publish(report: Report, key: str) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_table_artifact(report.table(), key=f"{key}-shards", description="reconcile: samples per shard")
    create_markdown_artifact(report.markdown(), key=f"{key}-summary", description="reconcile summary")


def open_store(output: str, verify: bool = False, client=None) -> Store:
    """The store of an output: `s3://bucket/prefix` (with `client`, else the default chain), else a directory."""
    if output.startswith("s3://"):
        return S3Store(output, client=client, verify=verify)
    return LocalStore(output.removeprefix("file://"), verify=verify)


def reconcile_local(out_dir: str, data: str, num_shards: int, verify: bool = False, retract: bool = True,
                    artifact_key: str | None = None, client=None) -> Report:
    """Reconcile an output (a directory, file:// or s3://) against a dataset readable from here; publish
    artifacts when in a run. `client`: the boto3 client for s3:// (see tasks.credentials)."""
    if not Path(data).is_file():
        raise FileNotFoundError(f"reconcile: dataset {data!r} is not readable from the orchestrator")
    store = open_store(out_dir, verify, client)
    report = reconcile_output(store, dataset_ids(data), num_shards, retract=retract)
    if artifact_key:
        _publish(report, artifact_key)
    return report


@task(name="reconcile", cache_policy=NO_CACHE, task_run_name="reconcile-{num_shards}-shards")
def reconcile(out_dir: str, data: str, num_shards: int, verify: bool = False, artifact_key: str = "reconcile",
              aws_credentials: str | None = None) -> dict:
    """Task: reconcile, publish a shard table and a markdown summary; the summary dict is the result.
    `out_dir`: a directory, file:// or s3:// (reached with the `aws_credentials` block, else the default chain)."""
    client = None
    if out_dir.startswith("s3://"):
        from .credentials import load_access

        client = load_access(aws_credentials).client()
    report = reconcile_local(out_dir, data, num_shards, verify=verify, retract=True, artifact_key=artifact_key,
                             client=client)
    get_run_logger().info("reconcile: %s", json.dumps(report.summary()))
    return {**report.summary(), "missing_ids": {str(k): v[:100] for k, v in report.missing_ids.items()}}
