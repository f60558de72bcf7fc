"""Reconcile what landed in the output against the dataset, and seal a complete run.

`reconcile_output` scans the output (`hsextract.output.journal.scan`: every shard journal, and the listing of every
stored object), then accounts for each of the dataset's sample ids: done (in a stored object whose size and
checksum match its journal entry), skipped (by reason), or missing; given each record's digest too (with
`verify`), a stored sample whose record changed under its id since is counted `changed`, and the output is
not complete. Samples stored twice resolve to one copy
in the index. The seal is true or absent: an output found incomplete, or holding more than one recipe, loses
its `_SUCCESS` and `_index.jsonl` first (a stale seal is never trusted). Only when nothing is missing does it
write the index (one line per sample: id -> file, row, token offsets) and claim `_SUCCESS` with a create-only
write, so two reconcilers cannot both seal one run; the seal names the recipe's fingerprint, a generation
(one more than the seal it replaces) and the index's sha256. A seal whose index no longer matches the output
(a file retracted and redone since) is replaced. The same code serves a local directory and an S3 prefix.

No torch: the dataset's ids come from `hsextract.data.records`, the same code the worker assigns ids with.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from hsextract.data.assign import shard_of
from hsextract.data.records import iter_digests, iter_ids
from hsextract.output.journal import INDEX_NAME, JOURNAL_NAME, SUCCESS_NAME, UNSEALED_NAME, line, scan
from hsextract.store import Store


@dataclass
class ShardReport:
    """One shard's samples: expected by the dataset, done, missing, skipped by reason."""
    expected: int = 0
    done: int = 0
    missing: int = 0
    skipped: Counter = field(default_factory=Counter)

    def row(self) -> dict:
        """The shard's row of the reconcile table."""
        return {"expected": self.expected, "done": self.done, "missing": self.missing,
                "skipped": sum(self.skipped.values())}


@dataclass
class Report:
    """What reconcile found: every dataset sample accounted for, and whether this call sealed the run."""
    num_shards: int
    expected: int = 0
    done: int = 0
    duplicated: int = 0                  # samples with more than one good stored copy (index keeps one)
    skipped: Counter = field(default_factory=Counter)  # reason -> samples
    missing_ids: dict[int, list[str]] = field(default_factory=dict)  # shard -> ids to re-run
    changed_ids: list[str] = field(default_factory=list)  # stored, but their record changed under the id since
    missing_objects: list[str] = field(default_factory=list)  # journaled but not stored
    corrupt_objects: list[str] = field(default_factory=list)  # stored, but size/checksum differ from journal
    unjournaled_objects: int = 0         # batch files no journal names (half-done writes; ignored)
    shards: dict[int, ShardReport] = field(default_factory=dict)
    sealed: bool = False                 # this reconcile wrote _SUCCESS
    already_sealed: bool = False         # _SUCCESS existed (another reconciler, or an earlier run)
    unsealed: bool = False               # this reconcile removed a seal that no longer held
    recipes: dict[str, list[str]] = field(default_factory=dict)  # fingerprint -> shard dirs (more than one: mixed)
    generation: int = 0                  # the seal's generation, when sealed
    seconds: float = 0.0

    @property
    def fingerprint(self) -> str | None:
        """The output's one recipe fingerprint (None: none recorded, or more than one)."""
        return next(iter(self.recipes)) if len(self.recipes) == 1 else None

    @property
    def mixed(self) -> bool:
        """More than one recipe in the output: not one dataset, never sealed."""
        return len(self.recipes) > 1

    @property
    def missing(self) -> int:
        """Samples neither stored nor skipped."""
        return sum(len(v) for v in self.missing_ids.values())

    @property
    def complete(self) -> bool:
        """Nothing missing or changed, one recipe, and something to account for (the run can be sealed: an
        empty dataset is no success)."""
        return self.missing == 0 and not self.changed_ids and not self.mixed and self.expected > 0

    @property
    def shards_to_rerun(self) -> list[int]:
        """Shards with missing samples."""
        return sorted(s for s, ids in self.missing_ids.items() if ids)

    def summary(self) -> dict:
        """The report as JSON-able numbers (the task's result, and the _SUCCESS marker's body)."""
        return {"num_shards": self.num_shards, "expected": self.expected, "done": self.done,
                "missing": self.missing, "changed": len(self.changed_ids),
                "changed_ids": self.changed_ids[:20], "duplicated": self.duplicated, "skipped": dict(self.skipped),
                "missing_objects": len(self.missing_objects), "corrupt_objects": len(self.corrupt_objects),
                "unjournaled_objects": self.unjournaled_objects, "shards_to_rerun": self.shards_to_rerun,
                "complete": self.complete, "sealed": self.sealed, "already_sealed": self.already_sealed,
                "unsealed": self.unsealed, "fingerprint": self.fingerprint, "recipes": self.recipes,
                "generation": self.generation, "seconds": round(self.seconds, 3)}

    def markdown(self) -> str:
        """The summary artifact: counts, skip reasons, missing and corrupt objects, shards to re-run."""
        lines = [f"**{'complete' if self.complete else 'INCOMPLETE'}**: {self.done:,} of {self.expected:,} "
                 f"samples stored, {sum(self.skipped.values()):,} skipped, {self.missing:,} missing, "
                 f"{self.duplicated:,} duplicated (one copy indexed)."]
        if self.skipped:
            lines.append("Skipped by reason: " + ", ".join(f"`{r}` {n:,}" for r, n in self.skipped.most_common()))
        for title, items in (("Missing objects", self.missing_objects), ("Corrupt objects", self.corrupt_objects)):
            if items:
                lines.append(f"{title} ({len(items)}): {_listed(items)}")
        if self.mixed:
            lines.append(f"**Mixed recipes** ({len(self.recipes)}): " + "; ".join(
                f"`{fp}` in {', '.join(dirs[:5])}" for fp, dirs in self.recipes.items())
                + ". Not one dataset: `hsextract fsck` lists which files are which.")
        if self.changed_ids:
            lines.append(f"**Changed records** ({len(self.changed_ids)}): the dataset's records under "
                         f"{_listed(self.changed_ids)} are not the ones their stored samples were made from. A "
                         f"changed dataset takes a new output.")
        if self.shards_to_rerun:
            lines.append(f"Shards to re-run: {self.shards_to_rerun}")
        seal = (f"_SUCCESS written (generation {self.generation})" if self.sealed else
                f"_SUCCESS already present (generation {self.generation})" if self.already_sealed else
                "a stale _SUCCESS removed: not sealed" if self.unsealed else "not sealed")
        lines.append(f"Recipe `{self.fingerprint or '-'}`; {seal}; reconciled in {self.seconds:.2f}s.")
        return "\n\n".join(lines)

    def table(self) -> list[dict]:
        """The per-shard table artifact's rows."""
        return [{"shard": s, **r.row()} for s, r in sorted(self.shards.items())]


def _listed(items: list[str], most: int = 20) -> str:
    """The first `most` items, quoted, and "..." when there are more."""
    return ", ".join(f"`{k}`" for k in items[:most]) + (" ..." if len(items) > most else "")


def reconcile_output(store: Store, dataset_ids: Iterable[str | tuple[str, str | None]], num_shards: int,
                     seal: bool = True, retract: bool = False, verify: bool = False) -> Report:
    """Account for every dataset id; write the index and claim `_SUCCESS` when nothing is missing.

    `dataset_ids`: ids, or (id, record digest) pairs (`records.iter_digests`): then a stored sample whose
    journaled record digest differs is `changed`, and the output not complete.
    `verify`: compare each batch file's sha256 too, not only its size (local files are read, the opt-in; on S3
    always: the sha256 S3 verified at upload and holds with the object, one HEAD each, no object read).
    `retract`: append a `lost` entry to the journal of every missing or corrupt object, so the next run of its
    shard recomputes those samples instead of trusting the journal."""
    started = time.monotonic()
    report = Report(num_shards)
    state = scan(store, checksums=verify or store.local_path("") is None)
    report.recipes = state.fingerprints()
    where, copies, lost = _locate(state, report)
    previous = _current_seal(store, state) if seal else None
    if (lost or report.mixed) and seal:  # before anything else: no reader trusts a stale seal
        report.unsealed = _unseal(store, state, previous, "objects lost or corrupt" if lost else "mixed recipes")
    if retract:
        for shard_dir, name, why in lost:
            store.append_lines(f"{shard_dir}/{JOURNAL_NAME}",
                               line({"kind": "lost", "file": name, "why": why, "time": round(time.time(), 3)}))
    journaled = {f"{shard}/{entry['file']}" for shard, entry in state.files} | {f"{s}/{n}" for s, n in state.lost}
    report.unjournaled_objects = sum(1 for k in state.objects if k.endswith(".safetensors") and k not in journaled)
    report.duplicated = sum(1 for n in copies.values() if n > 1)
    seen = _account(report, dataset_ids, where, state.skipped, state.sources)
    if seal and not report.complete and not report.unsealed:
        report.unsealed = _unseal(store, state, previous, f"{report.missing} sample(s) missing" if report.missing
                                  else f"{len(report.changed_ids)} record(s) changed under their ids")
    elif report.complete and seal:
        _seal(store, state, report, [(i, spot) for i, spot in where.items() if i in seen], started, previous)
    report.seconds = time.monotonic() - started
    return report


def _unseal(store: Store, state, previous: dict | None, why: str) -> bool:
    """Remove `_SUCCESS`, say so in `_UNSEALED` (its generation, why), then remove the index it vouched for;
    whether there was a seal."""
    had = SUCCESS_NAME in state.objects
    if had:
        store.delete(SUCCESS_NAME)
        store.write(UNSEALED_NAME, json.dumps({"time": round(time.time(), 3), "why": why,
                                               "generation": int((previous or {}).get("generation") or 0)}).encode())
    if INDEX_NAME in state.objects:
        store.delete(INDEX_NAME)
    return had


def _locate(state, report: Report):
    """Check every live journaled file against the listing: ({id: (key, row, start, end)} of the first good
    copy, copies per id, [(shard dir, file, why)] of the missing and corrupt ones (also put in `report`))."""
    where: dict[str, tuple[str, int, int | None, int | None]] = {}
    copies: Counter = Counter()
    lost: list[tuple[str, str, str]] = []
    for shard_dir, entry in state.files:
        key = f"{shard_dir}/{entry['file']}"
        obj = state.objects.get(key)
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
        start: int | None = 0
        for row, (sample_id, length) in enumerate(zip(entry["ids"], lengths)):
            copies[sample_id] += 1
            end = None if length is None or start is None else start + length
            where.setdefault(sample_id, (key, row, start, end))
            start = end
    return where, copies, lost


def _account(report: Report, dataset_ids: Iterable[str | tuple[str, str | None]], where: dict,
             skipped: dict[str, str], sources: dict[str, str]) -> set[str]:
    """Count each distinct dataset id, per shard, as done, skipped or missing (and a stored one whose record
    digest, where given, differs from the journal's as changed); returns the ids seen."""
    seen: set[str] = set()
    missing: dict[int, list[str]] = defaultdict(list)
    for item in dataset_ids:
        sample_id, digest = item if isinstance(item, tuple) else (item, None)
        if sample_id in seen:
            continue  # a repeated id in the dataset is one sample (the worker skips the repeats)
        seen.add(sample_id)
        shard = shard_of(sample_id, report.num_shards)
        row = report.shards.setdefault(shard, ShardReport())
        row.expected += 1
        if sample_id in where:
            row.done += 1
            if digest and sources.get(sample_id) and sources[sample_id] != digest:
                report.changed_ids.append(sample_id)
        elif sample_id in skipped:
            row.skipped[skipped[sample_id]] += 1
            report.skipped[skipped[sample_id]] += 1
        else:
            row.missing += 1
            missing[shard].append(sample_id)
    report.expected = len(seen)
    report.done = sum(r.done for r in report.shards.values())
    report.missing_ids = dict(missing)
    return seen


def _seal(store: Store, state, report: Report, index: list[tuple[str, tuple]], started: float,
          previous: dict | None) -> None:
    """Claim `_SUCCESS` for the index of `index`: already there when a seal holds this very index (its sha256);
    a seal of another index (the output changed since) is removed and replaced, one generation on. The index
    is written before the seal is claimed (create-only): `report.sealed` if this call won it."""
    body = ("\n".join(json.dumps({"id": i, "file": k, "row": r, "start": s, "end": e}, separators=(",", ":"))
                      for i, (k, r, s, e) in index) + "\n").encode()
    digest = hashlib.sha256(body).hexdigest()
    if previous is not None and not report.unsealed and previous.get("index_sha256") == digest \
            and previous.get("fingerprint") == report.fingerprint:
        report.already_sealed, report.generation = True, int(previous.get("generation") or 1)
        return
    if previous is not None and not report.unsealed and SUCCESS_NAME in state.objects:  # another index's: stale
        report.unsealed = _unseal(store, state, previous, "the output changed since it was sealed")
    report.generation = int((previous or {}).get("generation") or 0) + 1
    store.write(INDEX_NAME, body)
    report.seconds = time.monotonic() - started
    marker = json.dumps({"time": round(time.time(), 3), "index": INDEX_NAME, "index_sha256": digest,
                         **report.summary(), "generation": report.generation, "sealed": True}).encode()
    report.sealed = store.create(SUCCESS_NAME, marker)
    report.already_sealed = not report.sealed
    if report.sealed and UNSEALED_NAME in state.objects:
        store.delete(UNSEALED_NAME)


def _current_seal(store: Store, state) -> dict | None:
    """The seal's body ({} when unreadable: stale); where a seal was removed, `_UNSEALED`'s (its generation);
    None when there is neither."""
    name = SUCCESS_NAME if SUCCESS_NAME in state.objects else UNSEALED_NAME if UNSEALED_NAME in state.objects \
        else None
    if name is None:
        return None
    try:
        return json.loads(store.read(name))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return {}


def dataset_ids(path: str | Path) -> Iterator[str]:
    """The sample id of every record of a dataset, in file order (the worker's own ids)."""
    for sample_id, _ in iter_ids(path):
        yield sample_id


def reconcile_dataset(store: Store, data: str, num_shards: int, verify: bool = False, retract: bool = True,
                      artifact_key: str | None = None) -> Report:
    """Reconcile an output against a dataset readable from here; publish the table and the summary as
    artifacts under `artifact_key` (inside a run). `verify`: the full check: every stored file's bytes, and every
    record's content against the digest its samples were journaled with (ids alone otherwise)."""
    if not Path(data).exists():
        raise FileNotFoundError(f"reconcile: dataset {data!r} is not readable from the orchestrator")
    ids = iter_digests(data) if verify else dataset_ids(data)
    report = reconcile_output(store, ids, num_shards, retract=retract, verify=verify)
    if artifact_key:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        create_table_artifact(report.table(), key=f"{artifact_key}-shards", description="reconcile: samples per shard")
        create_markdown_artifact(report.markdown(), key=f"{artifact_key}-summary", description="reconcile summary")
    return report


@task(name="reconcile", cache_policy=NO_CACHE, task_run_name="reconcile-{num_shards}-shards")
def reconcile(store: Store, data: str, num_shards: int, verify: bool = False, artifact_key: str = "reconcile") -> dict:
    """Task: reconcile the output in `store` against `data`, retract what is lost, seal it when complete, publish
    a shard table and a markdown summary; returns the summary (with up to 100 missing ids per shard)."""
    report = reconcile_dataset(store, data, num_shards, verify=verify, retract=True, artifact_key=artifact_key)
    get_run_logger().info("reconcile %s: %s", store.uri, json.dumps(report.summary()))
    return {**report.summary(), "missing_ids": {str(k): v[:100] for k, v in report.missing_ids.items()}}
