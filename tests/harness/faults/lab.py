"""The lab every fault row runs in, and how a row's outcome is judged and audited.

`Lab` holds the real system (sshd hosts, the S3 endpoint, the tiny model, datasets); `Case` is one row's
dirs, inventory and runs of the `extract` flow; `audit` counts what really landed; `leftovers` counts
flow and task runs left Pending or Running.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness.inventory import ssh_host_entry, write_inventory
from hsextract import tiny

HEARTBEAT_S = 0.5
FAST = dict(heartbeat_interval_s=HEARTBEAT_S, poll_interval_s=0.25, launch_timeout_s=15, stall_timeout_s=2.0,
            host_timeout_s=5, token_budget=256, layers="1,3", device="cpu", status_interval_s=5)


@dataclass
class Outcome:
    observed: str                 # "Completed" or "Failed: <reason>"
    detect_s: float | None = None
    rerun: str = "-"
    lost: int = 0
    duplicated: int = 0
    skipped: int = 0
    left: int = 0
    note: str = ""


@dataclass
class Row:
    group: str
    name: str
    fault: str
    expected: str                 # "Completed" or "Failed"
    words: tuple[str, ...]        # each must appear in the faulted run's reason (Failed) or note
    run: Callable[["Lab", "Case"], Outcome]
    fast: bool = False
    rerun_needed: bool = True     # False: nothing ran to completion to re-run (a refusal, an audit)

    def passed(self, o: Outcome) -> bool:
        ok = o.observed.split(":")[0] == self.expected and all(w in o.observed + o.note for w in self.words)
        rerun = o.rerun.startswith("Completed") or (o.rerun == "-" and (self.expected == "Completed"
                                                                         or not self.rerun_needed))
        return ok and rerun and o.lost == o.duplicated == o.left == 0


class Lab:
    """The real system every row runs against, shared by the rows (each row has its own dirs and run name)."""

    def __init__(self, work: Path, farm, s3_url: str, model: Path, data: Path):
        self.work, self.farm, self.s3_url, self.model, self.data = work, farm, s3_url, model, data
        self.long_data = tiny.build_dataset(work / "long.jsonl", 300, seed=8)  # several files: time to strike
        self.secrets: list[str] = []  # every access key id and secret key a row handed out: looked for at the end
        self.key_ids: set[str] = set()  # which of them are access key ids (plain fields of the Prefect block)
        self.said: list[str] = []     # every row's observed reason and note (exceptions reach users there)
        self.argv_hits: list[str] = []  # secrets seen in a process's argv or environment while rows ran
        self.served = None            # the orchestrator rows' own Prefect server and worker, made on first use
        self.seconds: dict[str, float] = {}  # each row's wall time
        self._n = 0
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch_processes(self, interval_s: float = 0.2) -> None:
        """Scan every process's argv and environment for the handed-out secrets until `close()`."""
        def scan():
            while not self._watching.wait(interval_s):
                for proc in Path("/proc").iterdir():
                    if not proc.name.isdigit() or not self.secrets:
                        continue
                    for part in ("cmdline", "environ"):
                        try:
                            data = (proc / part).read_bytes()
                        except OSError:
                            continue
                        self.argv_hits += [f"pid {proc.name} {part}" for s in self.secrets if s.encode() in data]
        self._watcher = threading.Thread(target=scan, name="secret-watch", daemon=True)
        self._watcher.start()

    @property
    def watching(self) -> bool:
        return self._watcher is not None and self._watcher.is_alive()

    def close(self) -> None:
        self._watching.set()
        if self._watcher:
            self._watcher.join(5)
        if self.served is not None:
            self.served.close()

    def case(self, row: Row) -> "Case":
        self._n += 1
        base = self.work / f"{self._n:02d}-{row.name}"
        base.mkdir(parents=True)
        return Case(self, row, base)


@dataclass
class Case:
    """One row's dirs, inventory and runs."""

    lab: Lab
    row: Row
    base: Path
    started: float = field(default_factory=time.time)
    data: Path | None = None      # the row's dataset (the lab's short one unless the row sets it)

    def __post_init__(self):
        self.data = self.data or self.lab.data

    @property
    def run_name(self) -> str:
        return self.row.name

    def workdir(self, host: str) -> Path:
        return self.base / f"w-{host}"

    def inventory(self, hosts=("h1",), gpus=(0,), tag: str = "hosts", **per_host) -> str:
        entries = []
        for name in hosts:
            extra = per_host.get(name, {})
            entries.append(ssh_host_entry(self.lab.farm.host(name), extra.pop("workdir", self.workdir(name)),
                                          gpus=gpus, **extra))
        return str(write_inventory(self.base / f"{tag}.yaml", entries))

    def local_out(self) -> str:
        return f"file://{self.base / 'out'}"

    def flow(self, **kwargs):
        """Run `extract` (fault-matrix defaults under `kwargs`); (state, seconds it took, reason text)."""
        from flows.extract import extract

        params = {**FAST, "model": str(self.lab.model), "data": str(self.data), "run_name": self.run_name,
                  **kwargs}
        began = time.monotonic()
        state = extract(return_state=True, **params)
        return state, time.monotonic() - began, reason(state)

    def flow_in_thread(self, **kwargs) -> dict:
        box: dict = {}

        def go():
            box["state"], box["seconds"], box["reason"] = self.flow(**kwargs)

        box["thread"] = threading.Thread(target=go, daemon=True)
        box["thread"].start()
        return box

    def control_dir(self, host: str, shard: int = 0, num_shards: int = 1) -> Path:
        return self.workdir(host) / "runs" / self.run_name / f"shard-{shard:05d}-of-{num_shards:05d}"

    def wait_extracting(self, host: str, shard: int = 0, num_shards: int = 1, timeout: float = 60,
                        files: int = 1) -> int:
        """The worker's pid once its heartbeat says it is extracting (and has journaled `files` files)."""
        control, deadline = self.control_dir(host, shard, num_shards), time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                beat = json.loads((control / "heartbeat.json").read_text())
                if beat.get("phase") == "extracting" and beat.get("files", 0) >= files:
                    return int((control / "pid").read_text())
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.row.name}: the worker on {host} never reached extracting in {timeout}s; "
                             f"{control}: {sorted(p.name for p in control.glob('*')) if control.exists() else 'no dir'}")

    def task_runs(self, state) -> list:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with get_client(sync_client=True) as client:
            return client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))

    def task_failed_at(self, state) -> float | None:
        """Wall time the first task run of the flow run went Failed (None if none did)."""
        times = [t.state.timestamp.timestamp() for t in self.task_runs(state) if t.state and t.state.is_failed()]
        return min(times) if times else None

    def launch_took(self, state) -> float | None:
        """Seconds from a failed launch task's start to its Failed state."""
        took = [t.state.timestamp.timestamp() - t.start_time.timestamp() for t in self.task_runs(state)
                if t.name.startswith("launch-") and t.state and t.state.is_failed() and t.start_time]
        return min(took) if took else None

    def finish(self, observed: str, detect_s: float | None, rerun_kwargs: dict | None, output: str,
               client=None, note: str = "", rerun: str = "-") -> Outcome:
        """Take the re-run path (unless None; `rerun` says how one that already happened ended), then audit
        the output and the Prefect records."""
        if rerun_kwargs is not None:
            state, _, why = self.flow(output=output, **rerun_kwargs)
            rerun = "Completed" if state.is_completed() else f"Failed: {why}"
        lost, dup, skipped = audit(output, dataset_ids(self.data), client)
        note = "; ".join(filter(None, [note, f"{skipped} skipped with a reason" if skipped else ""]))
        return Outcome(observed, detect_s, rerun, lost, dup, skipped, leftovers(self.started), note)


def dataset_ids(path: Path) -> list[str]:
    """The ids of the dataset's lines that parse as objects with an id (a malformed line has none to lose)."""
    ids = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("id"), str):
            ids.append(record["id"])
    return ids


def reason(state) -> str:
    if state.is_completed():
        return ""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - the run's own error is the reason
        # RunIncomplete's details: "run R: N of M shard(s) failed; ...:\n- where: evidence\n- ...": the evidence
        text = getattr(exc, "details", "") or str(exc)
        return " ".join((text.split(":\n- ", 1)[1].replace("\n- ", " | ") if ":\n- " in text else text).split())
    return state.message or state.name


def observed(state, why: str) -> str:
    return "Completed" if state.is_completed() else f"Failed: {why}"


def audit(output: str, ids: list[str], client=None) -> tuple[int, int, int]:
    """(lost, duplicated, skipped) of the dataset in `output`, from what is really stored.

    stored: the reader's samples, checksums verified; duplicated: samples named by more than one journaled
    file that is really there; skipped: samples a journal skipped with a reason (other than a repeated id)."""
    import hsextract
    from hsextract.store import open_store
    from hsextract.output.journal import journal_keys, scan

    state = scan(open_store(output, client))
    copies = Counter(i for shard, entry in state.files if f"{shard}/{entry['file']}" in state.objects
                     for i in entry["ids"])
    read = ({s["id"] for s in hsextract.read_samples(output, verify=True, client=client)}
            if journal_keys(state.objects.values()) else set())
    skipped = {i for i in ids if i in state.skipped and i not in read}
    lost = sum(1 for i in set(ids) if i not in read and i not in skipped)
    return lost, sum(1 for n in copies.values() if n > 1), len(skipped)


def leftovers(since: float) -> int:
    """Flow runs and task runs created since `since` (wall time) still Pending or Running."""
    import datetime as dt

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterStartTime, FlowRunFilterState,
                                                FlowRunFilterStateType, TaskRunFilter, TaskRunFilterStartTime,
                                                TaskRunFilterState, TaskRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    after = dt.datetime.fromtimestamp(since - 1, dt.timezone.utc)
    live = [StateType.PENDING, StateType.RUNNING]
    with get_client(sync_client=True) as client:
        flows = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            start_time=FlowRunFilterStartTime(after_=after),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=live))))
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(
            start_time=TaskRunFilterStartTime(after_=after),
            state=TaskRunFilterState(type=TaskRunFilterStateType(any_=live))))
    return len(flows) + len(tasks)


def print_table(rows: list[tuple[Row, Outcome]], out=sys.stdout) -> None:
    head = ("group", "fault", "expected", "observed", "detect s", "lost", "dup", "left", "re-run", "pass")
    print("| " + " | ".join(head) + " |", file=out)
    print("|" + "|".join("---" for _ in head) + "|", file=out)
    for row, o in rows:
        seen = re.sub(r"`[^`]*`", "`...`", o.observed)  # the command a reason names: in the report, not here
        seen = seen if len(seen) <= 110 else seen[:107] + "..."
        cells = (row.group, row.fault, row.expected, seen.replace("|", "/"),
                 "-" if o.detect_s is None else f"{o.detect_s:.1f}", str(o.lost), str(o.duplicated), str(o.left),
                 o.rerun[:40], "yes" if row.passed(o) else "**NO**")
        print("| " + " | ".join(cells) + " |", file=out)


def print_notes(rows: list[tuple[Row, Outcome]], seconds: dict[str, float], out=sys.stdout) -> None:
    """What each row measured beyond its end state (the table's cells stay short)."""
    for row, o in rows:
        print(f"- `{row.name}` ({seconds.get(row.name, 0):.0f} s){': ' + o.note if o.note else ''}", file=out)


def run_rows(lab: Lab, rows: list[Row], progress=print) -> list[tuple[Row, Outcome]]:
    results = []
    for row in rows:
        case = lab.case(row)
        began = time.monotonic()
        try:
            outcome = row.run(lab, case)
        except Exception as exc:  # noqa: BLE001 - a row that breaks is a failed row, not a stopped matrix
            outcome = Outcome(f"ERROR: {type(exc).__name__}: {' '.join(str(exc).split())}")
        results.append((row, outcome))
        lab.seconds[row.name] = time.monotonic() - began
        lab.said += [outcome.observed, outcome.note, outcome.rerun]
        progress(f"{row.group}/{row.name}: {'pass' if row.passed(outcome) else 'FAIL'} in "
                 f"{time.monotonic() - began:.1f}s: {outcome}")
    return results

