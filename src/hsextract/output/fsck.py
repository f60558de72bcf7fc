"""`hsextract fsck OUTPUT [--repair] [--verify]`: every problem of an output, and a repair that loses no good sample.

Found (each a `Problem`: where, what, and what the repair does about it):
  - a journal line that does not parse (a torn line in the middle: a disk or a copy cut it), or names a file
    that is not a plain file name: the shard cannot be read until it goes;
  - a journaled batch file that is missing, of another size than its journal recorded, or (`--verify`, or any
    file whose size already differs) whose checksum differs;
  - batch files no journal names, and temp files a crash left (`.*.tmp`);
  - more than one recipe in the output (the shards and files of each);
  - a seal (`_SUCCESS`) standing over any of the above.

`--repair`: the journal keeps its good lines (the bad ones are cut, the original kept beside it as
`journal.jsonl.fsck-<time>`); every missing or corrupt file is retracted with a `lost` entry (the next run of
its shard redoes exactly its samples, as it does every sample of a line that was cut: the journal ends with a
`reopened` entry, so the shard is no longer done); unjournaled and temp
files are removed; the seal and its index go (reconcile seals the output again once it is whole). Mixed recipes
are not repaired: which recipe to keep is a person's call (`hsextract fsck` lists the shards of each).

Exit codes: 0 clean, 1 problems found (with `--repair`: some remain that it does not mend), 2 the output cannot
be read. Works on any store (a directory, file://, s3://).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from hsextract.output.journal import FILE_NAME, INDEX_NAME, SUCCESS_NAME, UNSEALED_NAME, journal_keys, line
from hsextract.store import Store, open_store
from hsextract.store.base import intact_prefix


@dataclass
class Problem:
    """One thing wrong: its key (or shard), what, and what `--repair` does about it ("" when nothing)."""

    where: str
    what: str
    repair: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.what}" + (f" [repair: {self.repair}]" if self.repair else " [not repaired]")


@dataclass
class Shard:
    """One shard journal as fsck reads it: its good entries, its bad lines (number, text, why)."""

    key: str
    entries: list[dict]
    bad: list[tuple[int, str, str]]
    torn_tail: bool

    @property
    def dir(self) -> str:
        return self.key.split("/")[0]


def read_journal(store: Store, key: str) -> Shard:
    """Every line of a journal, good or bad (a torn last line is a crash's, and harmless: readers skip it)."""
    data = store.read(key)
    raw_lines = data.split(b"\n")
    entries, bad = [], []
    torn = intact_prefix(data) != data and not data.endswith(b"\n")
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip() or (torn and number == len(raw_lines)):
            continue
        try:
            entry = json.loads(raw)
            if not isinstance(entry, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            bad.append((number, raw[:120].decode(errors="replace"), f"does not parse ({exc})"))
            continue
        name = entry.get("file")
        if name is not None and not (isinstance(name, str) and FILE_NAME.fullmatch(name)):
            bad.append((number, raw[:120].decode(errors="replace"), f"names {name!r}, not a plain file name"))
            continue
        entries.append(entry)
    return Shard(key, entries, bad, torn)


def fsck(uri: str, repair: bool = False, verify: bool = False, client=None) -> dict:
    """Check (and with `repair`, mend) the output at `uri`; returns {"problems": [str], "repaired": [str],
    "remaining": [str], "files", "shards", "recipes"}. FileNotFoundError when there is no output there."""
    store = open_store(uri, client)
    objects = {o.key: o for o in store.list()}
    keys = journal_keys(objects.values())
    root = store.local_path("")
    if not keys and not (root is not None and root.is_dir()):
        raise FileNotFoundError(f"{store.uri}: no shard journals there (not an extraction output)")
    shards = [read_journal(store, key) for key in keys]
    problems: list[Problem] = []
    journaled: set[str] = set()
    retract: dict[str, list[tuple[str, str]]] = {}  # journal key -> [(file, why)]
    recipes: dict[str, list[str]] = {}
    for shard in shards:
        for number, text, why in shard.bad:
            problems.append(Problem(f"{shard.key}:{number}", f"line {why}: {text!r}",
                                    "cut from the journal; the samples of a file it named are redone"))
        lost = {e["file"] for e in shard.entries if e.get("kind") == "lost"}
        last_recipe = next((e for e in reversed(shard.entries) if e.get("kind") == "recipe"), None)
        if last_recipe is not None:
            recipes.setdefault(last_recipe.get("fingerprint", "?"), []).append(shard.dir)
        for entry in shard.entries:
            if entry.get("kind") != "file":
                continue
            key = f"{shard.dir}/{entry['file']}"
            journaled.add(key)
            if entry["file"] in lost:
                continue
            if (wrong := _file_problem(store, objects.get(key), key, entry, verify)) is not None:
                problems.append(Problem(key, wrong, f"retracted (a `lost` entry): the next run of {shard.dir} redoes "
                                                  f"its {len(entry['ids'])} sample(s)"))
                retract.setdefault(shard.key, []).append((entry["file"], wrong))
    strays = [k for k in objects if k.startswith("shard-") and (
        (k.endswith(".safetensors") and k not in journaled) or k.rsplit("/", 1)[-1].endswith(".tmp"))]
    for key in strays:
        problems.append(Problem(key, "a temp file a crash left" if key.endswith(".tmp") else
                                "a batch file no journal names (written, never journaled)", "removed"))
    if len(recipes) > 1:
        problems.append(Problem(store.uri, "mixed recipes: " + "; ".join(
            f"{fp} in {', '.join(dirs)}" for fp, dirs in recipes.items()) + " (not one dataset: keep one recipe's "
            "shards, move the others to an output of their own)"))
    if problems and SUCCESS_NAME in objects:
        problems.append(Problem(SUCCESS_NAME, "the output is sealed, and the seal does not hold",
                                "removed with its index (reconcile seals the output again once it is whole)"))
    repaired: list[str] = []
    if repair:
        repaired = _repair(store, shards, retract, strays, SUCCESS_NAME in objects and bool(problems), objects)
    remaining = [str(p) for p in problems if not (repair and p.repair)]
    return {"out": store.uri, "shards": len(shards), "files": len(journaled), "recipes": recipes,
            "problems": [str(p) for p in problems], "repaired": repaired, "remaining": remaining}


def _file_problem(store: Store, found, key: str, entry: dict, verify: bool) -> str | None:
    """What is wrong with the batch file a journal `entry` names (`found`: its listing, None when not there), or
    None; with `verify`, its bytes against the journal's checksum too."""
    from hsextract.output.batchfile import check_bytes, verify_mode

    if found is None:
        return "journaled, but not there"
    if found.size != entry["bytes"]:
        return f"{found.size} bytes, its journal recorded {entry['bytes']} (truncated or overwritten)"
    if verify:
        try:
            path = store.local_path(key)
            data = path.read_bytes() if path is not None else store.read(key)
            check_bytes(data, entry, store.where(key), verify_mode("fast"))
        except ValueError as exc:
            return str(exc).split(": ", 1)[-1]
    return None


def _repair(store: Store, shards: list[Shard], retract: dict, strays: list[str], unseal: bool,
            objects: dict) -> list[str]:
    """Mend what `fsck` found (see the module's docstring); returns what was done."""
    done = []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    if unseal:  # first: no reader trusts the seal while the rest is mended
        generation = _generation(store)
        store.delete(SUCCESS_NAME)
        store.write(UNSEALED_NAME, json.dumps({"time": round(time.time(), 3), "why": "fsck found problems",
                                               "generation": generation}).encode())
        if INDEX_NAME in objects:
            store.delete(INDEX_NAME)
        done.append(f"{SUCCESS_NAME} and {INDEX_NAME} removed")
    for shard in shards:
        lost = [line({"kind": "lost", "file": name, "why": f"fsck: {why}", "time": round(time.time(), 3)})
                for name, why in retract.get(shard.key, [])]
        if not shard.bad and not lost:
            continue
        if (holder := _busy(store, shard)) is not None:
            done.append(f"{shard.key}: not repaired: the shard is being written by pid {holder} (run fsck again "
                        f"once it ends)")
            continue
        original = store.read(shard.key)
        if shard.bad:
            store.write(f"{shard.key}.fsck-{stamp}", original)  # the journal as it was, beside it
            kept = b"".join(line(e) for e in shard.entries)
            reopened = line({"kind": "reopened", "why": f"fsck cut {len(shard.bad)} bad line(s): their samples "
                                                        f"are redone", "time": round(time.time(), 3)})
            store.write(shard.key, kept + b"".join(lost) + reopened)  # no longer ends `done`: the next run redoes
            done.append(f"{shard.key}: {len(shard.bad)} bad line(s) cut (the original: {shard.key}.fsck-{stamp})"
                        + (f", {len(lost)} file(s) retracted" if lost else ""))
        else:
            store.append_lines(shard.key, b"".join(lost))
            done.append(f"{shard.key}: {len(lost)} file(s) retracted")
    for key in strays:
        store.delete(key)
    if strays:
        done.append(f"{len(strays)} unjournaled or temp file(s) removed")
    return done


def _busy(store: Store, shard: Shard) -> str | None:
    """The pid holding a local shard's lock (a worker writing it), else None (free, or not a local output)."""
    import fcntl
    import os

    path = store.local_path(f"{shard.dir}/.lock")
    if path is None or not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)
    return None


def _generation(store: Store) -> int:
    try:
        return int(json.loads(store.read(SUCCESS_NAME)).get("generation") or 0)
    except (FileNotFoundError, ValueError, AttributeError):
        return 0
