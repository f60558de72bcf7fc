"""The append-only per-shard journal: the only record of what exists.

One JSON object per line in `<out>/<shard dir>/journal.jsonl`:
  {"kind": "file", "file", "ids", "tokens", "lengths", "bytes", "sha256", "time"}   after the file is durable
      (+ "from_memory": true when it went straight from memory to the store: journaled once verified there)
  {"kind": "skip", "id", "reason", "detail", "line", "time"}
  {"kind": "done", "summary": {...}, "time"}
  {"kind": "lost", "file", "why", "time"}   appended by reconcile: the file is gone or corrupt in the store,
                                            so its samples count as not written and a re-run redoes them
A batch file that no "file" entry names does not exist. A torn last line (a kill mid-append) is ignored
and cut off before the next append.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

JOURNAL_NAME = "journal.jsonl"


FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # what a journal may name: no path, no dot-file


def shard_dir_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def read_entries(path: Path) -> Iterator[dict]:
    """Complete entries of one journal, in order; a torn trailing line is left out."""
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
            raise ValueError(f"{where}:{number}: corrupt journal line: {raw[:120]!r}") from None
        name = entry.get("file") if isinstance(entry, dict) else None
        if name is not None and not (isinstance(name, str) and FILE_NAME.fullmatch(name)):
            raise ValueError(f"{where}:{number}: file {name!r} is not a plain file name: a journal names only "
                             f"files in its own shard's directory")
        yield entry


class Journal:
    """Appender for one shard's journal. `file` entries are fsynced; other entries ride along."""

    def __init__(self, shard_dir: Path):
        self.path = shard_dir / JOURNAL_NAME
        self._cut_torn_tail()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        self._lock = threading.Lock()

    def _cut_torn_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep == len(data):
            return
        with self.path.open("r+b") as handle:
            try:  # only the newline was lost: the entry is whole (read_entries returns it), keep it
                json.loads(data[keep:])
                handle.seek(0, os.SEEK_END)
                handle.write(b"\n")
            except json.JSONDecodeError:
                handle.truncate(keep)
            os.fsync(handle.fileno())

    def append(self, entry: dict, durable: bool = False) -> None:
        line = json.dumps({**entry, "time": round(time.time(), 3)}, separators=(",", ":")) + "\n"
        with self._lock:  # writer, uploader and main threads append
            os.write(self._fd, line.encode())
            if durable:
                os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


@dataclass
class OutputState:
    """What every journal under an output directory says is written or skipped, by sample id."""

    written: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (shard dir, file)
    skipped: dict[str, str] = field(default_factory=dict)  # id -> reason
    files: list[tuple[str, dict]] = field(default_factory=list)  # (shard dir, file entry) in order
    done_shards: set[str] = field(default_factory=set)
    duplicates: set[tuple[str, int]] = field(default_factory=set)  # (id, line) of repeated ids, recorded

    def finished(self, sample_id: str) -> bool:
        return sample_id in self.written or sample_id in self.skipped


def scan_output(out_dir: Path) -> OutputState:
    """Merge all shard journals under `out_dir` (any earlier shard count). First writer of an id wins."""
    return merge_journals((j.parent.name, list(read_entries(j)))
                          for j in sorted(out_dir.glob(f"shard-*/{JOURNAL_NAME}")))


def merge_journals(journals) -> OutputState:
    """Merge (shard dir, entries) pairs, in the order given (sorted by shard dir): first writer of an id wins."""
    state = OutputState()
    for shard, entries in journals:
        lost = {e["file"] for e in entries if e.get("kind") == "lost"}
        for entry in entries:
            kind = entry.get("kind")
            if kind == "file" and entry["file"] in lost:
                continue
            if kind == "file":
                state.files.append((shard, entry))
                for sample_id in entry["ids"]:
                    state.written.setdefault(sample_id, (shard, entry["file"]))
            elif kind == "skip" and entry["reason"] == "duplicate_id":
                state.duplicates.add((entry["id"], entry["line"]))
            elif kind == "skip":
                state.skipped.setdefault(entry["id"], entry["reason"])
            elif kind == "done":
                state.done_shards.add(shard)
    return state
