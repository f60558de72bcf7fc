"""The append-only per-shard journal: the only record of what exists. Its format, parsing and merging live here.

One JSON object per line in `<out>/<shard dir>/journal.jsonl`:
  {"kind": "file", "file", "ids", "tokens", "lengths", "bytes", "sha256", "time"}   after the file is durable
      (+ "from_memory": true when it went straight from memory to the store: journaled once verified there)
  {"kind": "skip", "id", "reason", "detail", "line", "time"}
  {"kind": "done", "summary": {...}, "time"}
  {"kind": "lost", "file", "why", "time"}   appended by reconcile: the file is gone or corrupt in the store,
                                            so its samples count as not written and a re-run redoes them
  {"kind": "reopened", "why", "time"}   appended by `hsextract fsck --repair` after it cut bad lines: the shard
                                            is no longer done, and its next run redoes what those lines named
  {"kind": "recipe", "fingerprint", "recipe": {...}, "time"}   what the states are made with
                                            (`hsextract.output.recipe`), appended by a run before its first file
                                            (and by a later run whose versions differ)
A batch file that no "file" entry names does not exist. A shard is complete while its journal's last entry
is "done" (a later "lost", or a new run's entries, reopen it). A torn last line (a kill mid-append) is
ignored by readers and cut off before the next append.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hsextract.errors import CorruptOutput
from hsextract.store import Store, StoredObject, open_store
from hsextract.store.local import repair_tail

JOURNAL_NAME = "journal.jsonl"
#: the output's seal (written by reconcile when every sample is accounted for), the index it vouches for, and
#: the note left where a seal was removed (the integrity contract: a seal is true or absent)
SUCCESS_NAME, INDEX_NAME, UNSEALED_NAME = "_SUCCESS", "_index.jsonl", "_UNSEALED"
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # what a journal may name: no path, no dot-file


def shard_dir_name(shard: int, num_shards: int) -> str:
    """`shard-00003-of-00008`: the directory (and key prefix) of shard 3 of 8."""
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def journal_key(shard: int, num_shards: int) -> str:
    """The journal's key under the output root."""
    return f"{shard_dir_name(shard, num_shards)}/{JOURNAL_NAME}"


def line(entry: dict) -> bytes:
    """One journal line: compact JSON and a newline."""
    return (json.dumps(entry, separators=(",", ":")) + "\n").encode()


def read_entries(path: Path) -> Iterator[dict]:
    """Complete entries of one journal file, in order; a torn trailing line is left out."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    yield from parse_entries(data, str(path))


def parse_entries(data: bytes, where: str) -> Iterator[dict]:
    """Entries of journal bytes (from disk or a store); a torn final line is left out, others must parse."""
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError:
            if number == len(lines):
                return  # torn final line: the append it belonged to never completed
            raise CorruptOutput(f"{where}:{number}: corrupt journal line: {raw[:120]!r} (`hsextract fsck OUTPUT "
                                f"--repair` cuts it; the samples of a file it named are redone)") from None
        name = entry.get("file") if isinstance(entry, dict) else None
        if name is not None and not (isinstance(name, str) and FILE_NAME.fullmatch(name)):
            raise CorruptOutput(f"{where}:{number}: file {name!r} is not a plain file name: a journal names only "
                                f"files in its own shard's directory")
        yield entry


def retractions_missing(mine: bytes, theirs: bytes, where: str) -> list[dict]:
    """The `lost` entries of `theirs` (the store's copy of a journal) that `mine` (a host's copy that is further
    along) lacks: reconcile retracted those files in the store after this host's last mirror."""
    have = {e["file"] for e in parse_entries(mine, "local journal") if e.get("kind") == "lost"}
    return [e for e in parse_entries(theirs, where) if e.get("kind") == "lost" and e["file"] not in have]


def lost_files(entries: Iterable[dict]) -> set[str]:
    """Files a journal's `lost` entries retract."""
    return {e["file"] for e in entries if e.get("kind") == "lost"}


class Journal:
    """Appender for one shard's journal file. `file` entries are fsynced; other entries ride along."""

    def __init__(self, shard_dir: Path):
        self.path = shard_dir / JOURNAL_NAME
        repair_tail(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        self._lock = threading.Lock()

    def append(self, entry: dict, durable: bool = False) -> None:
        """Add `entry` (stamped with the time); `durable`: fsync before returning."""
        data = line({**entry, "time": round(time.time(), 3)})
        with self._lock:  # writer, uploader and main threads append
            os.write(self._fd, data)
            if durable:
                os.fsync(self._fd)

    def close(self) -> None:
        """fsync and close the journal."""
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


@dataclass
class OutputState:
    """What every journal of an output says, merged (`merge_journals`; `hsextract.output.journal.scan` reads them)."""

    written: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (shard dir, file): first copy
    skipped: dict[str, str] = field(default_factory=dict)  # id -> reason (the first journaled)
    files: list[tuple[str, dict]] = field(default_factory=list)  # (shard dir, file entry) not retracted, in order
    lost: set[tuple[str, str]] = field(default_factory=set)  # (shard dir, file) retracted by a `lost` entry
    done_shards: set[str] = field(default_factory=set)  # shard dirs whose journal ends with `done`
    duplicates: set[tuple[str, int]] = field(default_factory=set)  # (id, line) of repeated ids, recorded
    objects: dict = field(default_factory=dict)  # key -> StoredObject: the store's listing, when scanned
    recipes: dict[str, dict] = field(default_factory=dict)  # shard dir -> its journal's last `recipe` entry
    sources: dict[str, str] = field(default_factory=dict)  # id -> digest of the record its first copy was made from

    def fingerprints(self) -> dict[str, list[str]]:
        """Recipe fingerprint -> the shard dirs whose journals were made with it (more than one: mixed)."""
        found: dict[str, list[str]] = {}
        for shard, entry in sorted(self.recipes.items()):
            found.setdefault(entry.get("fingerprint", "?"), []).append(shard)
        return found

    def finished(self, sample_id: str) -> bool:
        """Written or skipped by some run (either way: nothing to do for it)."""
        return sample_id in self.written or sample_id in self.skipped

    def done(self, shard: int, num_shards: int) -> bool:
        """Whether shard `shard` of `num_shards` is complete (its journal ends with `done`)."""
        return shard_dir_name(shard, num_shards) in self.done_shards


def merge_journals(journals: Iterable[tuple[str, list[dict]]]) -> OutputState:
    """Merge (shard dir, entries) pairs in the order given (sorted by shard dir, any shard counts mixed): the
    first writer of an id wins; files a `lost` entry retracts are left out, and their samples with them."""
    state = OutputState()
    for shard, entries in journals:
        lost = lost_files(entries)
        state.lost |= {(shard, name) for name in lost}
        for entry in entries:
            kind = entry.get("kind")
            if kind == "file" and entry["file"] not in lost:
                state.files.append((shard, entry))
                sources = entry.get("records_xxh3") or ()
                for n, sample_id in enumerate(entry["ids"]):
                    if sample_id not in state.written:
                        state.written[sample_id] = (shard, entry["file"])
                        if n < len(sources) and sources[n]:
                            state.sources[sample_id] = sources[n]
            elif kind == "skip" and entry["reason"] == "duplicate_id":
                state.duplicates.add((entry["id"], entry["line"]))
            elif kind == "skip":
                state.skipped.setdefault(entry["id"], entry["reason"])
            elif kind == "recipe":
                state.recipes[shard] = entry
        if entries and entries[-1].get("kind") == "done":
            state.done_shards.add(shard)
    return state


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
