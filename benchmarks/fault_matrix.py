"""The fault and abuse matrix: every injected fault against the real system, and how each one ended.

    .venv/bin/python benchmarks/fault_matrix.py [--fast] [--only NAME[,NAME...]] [--markdown FILE]

Real sshd hosts (two in network namespaces, one on loopback), a real S3 endpoint (moto) behind a fault proxy,
a real Prefect server, the tiny Qwen3.5 model. Each row injects one fault into a run of the `extract` flow,
then takes the re-run path (the same flow, same run name, fault removed) and audits what landed:

  fault           what was done to the run
  expected        the end state the product promises (Completed, or Failed with the reason named)
  observed        the end state of the faulted run, and the reason it gave (its first words)
  detect s        fault injected -> the run (or its shard's task) said so; for launch faults, from flow start
  lost / dup      dataset samples that are neither stored nor skipped with a reason / stored more than once,
                  after the re-run path (the reader, verifying checksums, against the dataset)
  left            flow runs and task runs left Pending or Running by the row
  re-run          the end state of the re-run path

A row passes when observed matches expected (and the reason holds the expected words), the re-run path
completes, lost == dup == left == 0. `--fast` is the subset CI runs (tests/integration/test_fault_matrix.py).
The process exits 1 if any row fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "src")]

from helpers import ssh_host_entry, write_inventory  # noqa: E402

from hsextract import tiny  # noqa: E402

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
    skipped_ok: int = 0           # samples the row's data makes skippable (data rows)

    def passed(self, o: Outcome) -> bool:
        ok = o.observed.split(":")[0] == self.expected and all(w in o.observed + o.note for w in self.words)
        rerun = o.rerun.startswith("Completed") or (o.rerun == "-" and self.expected == "Completed")
        return ok and rerun and o.lost == o.duplicated == o.left == 0


class Lab:
    """The real system every row runs against, shared by the rows (each row has its own dirs and run name)."""

    def __init__(self, work: Path, farm, s3_url: str, model: Path, data: Path):
        self.work, self.farm, self.s3_url, self.model, self.data = work, farm, s3_url, model, data
        self.long_data = tiny.build_dataset(work / "long.jsonl", 300, seed=8)  # several files: time to strike
        self.secrets: list[str] = []  # every key a row handed out: grepped for at the end
        self._n = 0

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

    def ctrl(self, host: str, shard: int = 0, num_shards: int = 1) -> Path:
        return self.workdir(host) / "runs" / self.run_name / f"shard-{shard:05d}-of-{num_shards:05d}"

    def wait_extracting(self, host: str, shard: int = 0, num_shards: int = 1, timeout: float = 60,
                        files: int = 1) -> int:
        """The worker's pid once its heartbeat says it is extracting (and has journaled `files` files)."""
        ctrl, deadline = self.ctrl(host, shard, num_shards), time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                beat = json.loads((ctrl / "heartbeat.json").read_text())
                if beat.get("phase") == "extracting" and beat.get("files", 0) >= files:
                    return int((ctrl / "pid").read_text())
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.row.name}: the worker on {host} never reached extracting in {timeout}s; "
                             f"{ctrl}: {sorted(p.name for p in ctrl.glob('*')) if ctrl.exists() else 'no dir'}")

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
               client=None, note: str = "") -> Outcome:
        """Take the re-run path (unless None), then audit the output and the Prefect records."""
        rerun = "-"
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
        text = str(exc)  # RunIncomplete: "run R: N failure(s), ...:\n- where: why\n- ...": the whys
        return " ".join((text.split(":\n- ", 1)[1].replace("\n- ", " | ") if ":\n- " in text else text).split())
    return state.message or state.name


def observed(state, why: str) -> str:
    return "Completed" if state.is_completed() else f"Failed: {why}"


def audit(output: str, ids: list[str], client=None) -> tuple[int, int, int]:
    """(lost, duplicated, skipped) of the dataset in `output`, from what is really stored.

    stored: the reader's samples, checksums verified; duplicated: samples named by more than one journaled
    file that is really there; skipped: samples a journal skipped with a reason (other than a repeated id)."""
    import hsextract
    from hsextract.journal import merge_journals, parse_entries

    if output.startswith("s3://"):
        bucket, _, prefix = output.removeprefix("s3://").partition("/")
        keys = set()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys |= {o["Key"].removeprefix(prefix).lstrip("/") for o in page.get("Contents", [])}
        journals = [(k.split("/")[0], list(parse_entries(client.get_object(
            Bucket=bucket, Key=f"{prefix}/{k}".lstrip("/"))["Body"].read(), k)))
            for k in sorted(keys) if k.endswith("/journal.jsonl")]
        exists = lambda shard, name: f"{shard}/{name}" in keys  # noqa: E731
    else:
        root = Path(output.removeprefix("file://"))
        journals = [(j.parent.name, list(parse_entries(j.read_bytes(), str(j))))
                    for j in sorted(root.glob("shard-*/journal.jsonl"))]
        exists = lambda shard, name: (root / shard / name).is_file()  # noqa: E731
    state = merge_journals(journals)
    copies = Counter(i for shard, entry in state.files if exists(shard, entry["file"]) for i in entry["ids"])
    read = {s["id"] for s in hsextract.read_samples(output, verify=True, client=client)} if journals else set()
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


# ----------------------------------------------------------------------------------------------------------------
# rows


def wrapper(case: Case, body: str, name: str = "python") -> str:
    """An interpreter that passes deploy's checks (it execs the real one) but does `body` when asked to extract."""
    path = case.base / name
    path.write_text(f"#!/bin/sh\nif [ \"$3\" = extract ]; then\n{body}\nfi\nexec {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def launch_fault(python_body: str | None = None, python: str | None = None, before=None):
    """A row whose launch goes wrong: detection from flow start; the re-run uses the real interpreter."""
    def run(lab: Lab, case: Case) -> Outcome:
        py = python or (wrapper(case, python_body) if python_body else None)
        hosts = case.inventory(("h1",), h1={"python": py} if py else {})
        if before:
            before(case)
        state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
        if before:  # undo what `before` did before the re-run
            getattr(before, "undo", lambda c: None)(case)
        took = case.launch_took(state)  # a deploy failure has no launch: flow start -> Failed then
        return case.finish(observed(state, why), seconds if took is None else took,
                           dict(hosts=case.inventory(tag="fixed")), case.local_out(),
                           note=f"flow start -> Failed {seconds:.1f}s" + (" (launch task)" if took else ""))
    return run


def log_dir_unwritable(case: Case) -> None:
    # root ignores permission bits: the log path is a directory, so the launch's `> worker.log` fails
    (case.ctrl("h1") / "worker.log").mkdir(parents=True)


log_dir_unwritable.undo = lambda case: shutil.rmtree(case.ctrl("h1") / "worker.log")


def clean_run(lab: Lab, case: Case) -> Outcome:
    state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(("h1", "h2"), gpus=(0,)))
    return case.finish(observed(state, why), None, {"hosts": case.inventory(("h1", "h2"))}, case.local_out(),
                       note=f"{seconds:.1f}s")


def signal_mid_run(sig: signal.Signals):
    def run(lab: Lab, case: Case) -> Outcome:
        case.data = lab.long_data
        box = case.flow_in_thread(output=case.local_out(), hosts=case.inventory(), token_budget=128)
        pid = case.wait_extracting("h1")
        os.kill(pid, sig)
        acted = time.time()
        box["thread"].join(300)
        failed_at = case.task_failed_at(box["state"])
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT) if _alive(pid) else None
        return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted,
                           {"hosts": case.inventory(tag="fixed")}, case.local_out())
    return run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def memory_cgroup(name: str) -> tuple[Path, str, str, Callable[[Path], str]]:
    """A fresh memory cgroup: (dir, limit file, usage file, oom-kill count reader), v2 or v1."""
    v2 = Path("/sys/fs/cgroup")
    if "memory" in ((v2 / "cgroup.controllers").read_text() if (v2 / "cgroup.controllers").exists() else ""):
        cg = v2 / name
        cg.mkdir()
        return cg, "memory.max", "memory.current", lambda d: _field(d / "memory.events", "oom_kill")
    cg = v2 / "memory" / name
    cg.mkdir()
    return cg, "memory.limit_in_bytes", "memory.usage_in_bytes", lambda d: _field(d / "memory.oom_control", "oom_kill")


def _field(path: Path, key: str) -> str:
    return dict(line.split() for line in path.read_text().splitlines() if line.strip()).get(key, "?")


def oom_kill(lab: Lab, case: Case) -> Outcome:
    """A memory cgroup around the worker. It uploads from memory over a slow link, so its files pile up in
    memory; once it extracts, its limit drops to what it uses plus 1 MiB: the kernel OOM-kills it (SIGKILL)."""
    cg, limit, usage, oom_kills = memory_cgroup(f"hsx-oom-{os.getpid()}-{case.run_name}")
    case.data = lab.long_data
    store = Store(lab, case, bandwidth=20_000)
    try:
        py = wrapper(case, f"echo $$ > {cg}/cgroup.procs")
        kwargs = dict(hosts=case.inventory(("lo",)), aws_credentials=store.block, upload_from="memory")
        box = case.flow_in_thread(output=store.output, token_budget=128,
                                  **{**kwargs, "hosts": case.inventory(("lo",), tag="oom", lo={"python": py})})
        case.wait_extracting("lo", files=0)  # from memory, a file is journaled only once stored: slow here
        time.sleep(1)
        (cg / limit).write_text(f"{int((cg / usage).read_text()) + (1 << 20)}\n")
        acted = time.time()
        box["thread"].join(300)
        failed_at = case.task_failed_at(box["state"])
        store.heal()
        return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted, kwargs,
                           store.output, client=store.client, note=f"kernel oom_kill count {oom_kills(cg)}")
    finally:
        store.close()
        for pid in (cg / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.3)
        cg.rmdir()


def cut_host(seconds: float):
    def run(lab: Lab, case: Case) -> Outcome:
        case.data = lab.long_data
        box = case.flow_in_thread(output=case.local_out(), hosts=case.inventory(("h1", "h2"), gpus=(0,)),
                                  token_budget=128, num_shards=2)
        case.wait_extracting("h1", 0, 2)
        lab.farm.cut("h1")
        acted = time.time()
        time.sleep(seconds)
        lab.farm.restore("h1")
        box["thread"].join(300)
        failed_at = case.task_failed_at(box["state"])
        return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted,
                           {"hosts": case.inventory(("h2",), tag="elsewhere")}, case.local_out(),
                           note=f"cut {seconds:.0f}s; re-run on h2 only")
    return run


def reboot(lab: Lab, case: Case) -> Outcome:
    """Every process of the host's shard gone and sshd down for a while; the files stay."""
    case.data = lab.long_data
    box = case.flow_in_thread(output=case.local_out(), hosts=case.inventory(), token_budget=128)
    pid = case.wait_extracting("h1")
    lab.farm.stop("h1")
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    acted = time.time()
    time.sleep(2)
    lab.farm.start("h1")
    box["thread"].join(300)
    failed_at = case.task_failed_at(box["state"])
    return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted,
                       {"hosts": case.inventory(tag="fixed")}, case.local_out(), note="sshd down 2s")


def duplicate_launch(lab: Lab, case: Case) -> Outcome:
    case.data = lab.long_data
    hosts = case.inventory()
    first = case.flow_in_thread(output=case.local_out(), hosts=hosts, token_budget=128)
    case.wait_extracting("h1")
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
    first["thread"].join(300)
    both = "Completed" if state.is_completed() and first["state"].is_completed() else \
        f"Failed: second: {why or 'ok'}; first: {first['reason'] or 'ok'}"
    return case.finish(both, None, None, case.local_out(), note="second run adopted the first's worker")


def wrong_bundle(lab: Lab, case: Case) -> Outcome:
    """The bundle's bytes arrive altered (its hash no longer matches): nothing of it may be unpacked or run."""
    import dataclasses

    from tasks.bundle import build_bundle
    from tasks.deploy import DeployFailed, deploy_host
    from tasks.hosts import connect
    from tasks.inventory import load_inventory

    inventory = load_inventory(case.inventory())
    bundle = build_bundle(ROOT)
    altered = dataclasses.replace(bundle, data=bundle.data[:-64] + bytes(64))
    began = time.monotonic()
    try:
        with connect(inventory.hosts[0], inventory) as host:
            deploy_host(host, altered, "0.1.0", timeout=30)
        seen = "Completed"
    except DeployFailed as exc:
        seen = f"Failed: {' '.join(str(exc).split())}"
    seconds = time.monotonic() - began
    unpacked = (case.workdir("h1") / "bundles" / bundle.sha256).exists()
    return case.finish(seen, seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out(),
                       note="altered bundle unpacked!" if unpacked else "nothing unpacked")


def deploy_put_fails(lab: Lab, case: Case) -> Outcome:
    blocker = case.base / "not-a-dir"
    blocker.write_text("a file where the workdir's parent should be\n")
    hosts = case.inventory(h1={"workdir": blocker / "w"})
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
    return case.finish(observed(state, why), seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out())


@contextlib.contextmanager
def tmpfs(mount: Path, size: str):
    """A small disk of its own (root: CI runs as root), unmounted after."""
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def deploy_disk_full(lab: Lab, case: Case) -> Outcome:
    with tmpfs(case.base / "tiny-disk", "64k") as mount:
        # `lo`: a host in a network namespace has its own mount namespace and would not see this mount
        state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(("lo",),
                                                                                      lo={"workdir": mount / "w"}))
    return case.finish(observed(state, why), seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out())


def out_disk_full(lab: Lab, case: Case) -> Outcome:
    with tmpfs(case.base / "small-disk", "3m") as mount:
        case.data = lab.long_data
        output = f"file://{mount / 'out'}"
        state, seconds, why = case.flow(output=output, hosts=case.inventory(("lo",)))  # lo: sees this mount
        subprocess.run(["mount", "-o", "remount,size=256m", str(mount)], check=True)
        return case.finish(observed(state, why), None, {"hosts": case.inventory(("lo",), tag="fixed")}, output,
                           note="re-run after the disk grew")


def bad_input(make_args):
    """A parameter or input that must be refused fast, naming it; the re-run uses good input."""
    def run(lab: Lab, case: Case) -> Outcome:
        kwargs = make_args(case)
        state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(), **kwargs)
        return case.finish(observed(state, why), seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out())
    return run


def model_missing_shard(case: Case) -> dict:
    broken = case.base / "model"
    shutil.copytree(case.lab.model, broken)
    weights = sorted(broken.glob("*.safetensors"))
    weights[-1].unlink()
    return {"model": str(broken)}


class Store:
    """A bucket on the lab's moto behind a fault proxy, and a credentials block whose endpoint is the proxy."""

    def __init__(self, lab: Lab, case: Case, rule=None, bandwidth: float | None = None):
        import uuid

        import boto3
        from prefect_aws import AwsCredentials
        from s3faults import FaultProxy

        self.proxy = FaultProxy(lab.s3_url, rule, bandwidth).start()
        self.bucket = f"hsx-{case.run_name.replace('_', '-')}"
        self.client = boto3.client("s3", endpoint_url=lab.s3_url, region_name="us-east-1")
        self.client.create_bucket(Bucket=self.bucket)
        self.block = f"fm-{case.run_name.replace('_', '-')}"
        key_id, secret = f"AKIAHSX{uuid.uuid4().hex[:13].upper()}", f"hsx-secret-{uuid.uuid4().hex}"
        lab.secrets += [key_id, secret]
        AwsCredentials(aws_access_key_id=key_id, aws_secret_access_key=secret, region_name="us-east-1",
                       aws_client_parameters={"endpoint_url": self.proxy.url}).save(self.block, overwrite=True)
        self.output = f"s3://{self.bucket}/run"

    def heal(self) -> None:
        self.proxy.rule, self.proxy.bandwidth = (lambda method, path: None), None

    def close(self) -> None:
        self.proxy.stop()


def batch_put(method: str, path: str) -> bool:
    return method in ("PUT", "POST") and "/batch-" in path


def storage_fault(rule_for=None, bandwidth=None, strike=None, output_for=None, words=""):
    """A run on s3:// through the fault proxy; the re-run path goes through a healed proxy."""
    def run(lab: Lab, case: Case) -> Outcome:
        store = Store(lab, case, rule_for() if rule_for else None, bandwidth)
        try:
            hosts = case.inventory(("lo",))
            output = output_for(store) if output_for else store.output
            kwargs = dict(hosts=hosts, aws_credentials=store.block)
            if strike:
                case.data = lab.long_data
                box = case.flow_in_thread(output=output, token_budget=128, **kwargs)
                acted = strike(case, store)
                box["thread"].join(300)
                state, why = box["state"], box["reason"]
                failed_at = case.task_failed_at(state)
                detect = failed_at and failed_at - acted
            else:
                state, detect, why = case.flow(output=output, **kwargs)
                detect = None if state.is_completed() else detect
            store.heal()
            launched = any(t.name.startswith("launch-") for t in case.task_runs(state))
            return case.finish(observed(state, why), detect, kwargs, store.output, client=store.client,
                               note=f"{len(store.proxy.seen)} requests through the proxy"
                                    + ("" if launched else "; failed before any launch"))
        finally:
            store.close()
    return run


def burst(statuses=(503, 500, 503, 503, 500, 503)):
    def rule_for():
        pending = list(statuses)

        def rule(method, path):
            return pending.pop(0) if batch_put(method, path) and pending else None
        return rule
    return rule_for


def revoke_after(puts: int):
    def rule_for():
        seen = [0]

        def rule(method, path):
            if batch_put(method, path):
                seen[0] += 1
                return 403 if seen[0] > puts else None
            return None
        return rule
    return rule_for


def corrupt_spooled(case: Case, store: Store) -> float:
    """Flip bytes of a batch file waiting in the spool (the link is slow), before its upload."""
    spool = case.ctrl("lo") / "spool" / "shard-00000-of-00001"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        waiting = sorted(spool.glob("batch-*.safetensors"))
        if len(waiting) >= 10:  # more than the uploader has in flight: the newest one is still waiting
            victim = waiting[-1]
            with victim.open("r+b") as handle:  # the last bytes of the tensor data, inverted
                handle.seek(-64, os.SEEK_END)
                tail = handle.read(64)
                handle.seek(-64, os.SEEK_END)
                handle.write(bytes(b ^ 0xFF for b in tail))
            return time.time()
        time.sleep(0.02)
    raise AssertionError(f"no batch file waited in {spool}")


def object_deleted(lab: Lab, case: Case) -> Outcome:
    """A clean run, then one stored batch object deleted: the next run's reconcile must say so."""
    store = Store(lab, case)
    try:
        kwargs = dict(hosts=case.inventory(("lo",)), aws_credentials=store.block)
        first, _, why = case.flow(output=store.output, **kwargs)
        if not first.is_completed():
            return Outcome(f"ERROR: the clean first run failed: {why}")
        listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix="run/")["Contents"]
        victim = next(o["Key"] for o in listed if "/batch-" in o["Key"])
        store.client.delete_object(Bucket=store.bucket, Key=victim)
        state, seconds, why = case.flow(output=store.output, **kwargs)
        return case.finish(observed(state, why), seconds, kwargs, store.output, client=store.client,
                           note=f"deleted {victim}")
    finally:
        store.close()


def bad_lines(lab: Lab, case: Case) -> Outcome:
    """Malformed lines, an empty and an assistant-less conversation, an over-long one, a repeated id."""
    good = [line for line in lab.data.read_text().splitlines()[:30]]
    long_one = {"id": "overlong", "messages": [{"role": "user", "content": "ka " * 80},
                                               {"role": "assistant", "content": "lo " * 300}]}
    lines = [*good[:10], "{not json", json.dumps([1, 2]), json.dumps({"id": "empty", "messages": []}),
             json.dumps({"id": "noasst", "messages": [{"role": "user", "content": "hello there"}]}),
             json.dumps(long_one), good[3], *good[10:]]
    case.data = case.base / "bad.jsonl"
    case.data.write_text("\n".join(lines) + "\n")
    state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(), max_length=128)
    return case.finish(observed(state, why), None, {"hosts": case.inventory(), "max_length": 128},
                       case.local_out(), note="over-long one truncated to 128 tokens")


def secrets_at_rest(lab: Lab, case: Case) -> Outcome:
    """Every key the storage rows handed out, grepped for in every file the matrix produced (hosts' workdirs,
    outputs, logs) and in everything the Prefect server kept (logs, artifacts, task and flow run states)."""
    from prefect.client.orchestration import get_client

    if not lab.secrets:
        return Outcome("Completed", note="no storage row ran: no secret to look for")
    hits = []
    for path in lab.work.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits += [f"{path}" for secret in lab.secrets if secret.encode() in data]
    with get_client(sync_client=True) as client:
        texts = [log.message for log in client.read_logs()]
        texts += [json.dumps(a.data, default=str) + (a.description or "") for a in client.read_artifacts()]
        texts += [f"{t.name} {t.state.message if t.state else ''}" for t in client.read_task_runs()]
        texts += [json.dumps(f.parameters, default=str) + (f.state.message if f.state else "")
                  for f in client.read_flow_runs()]
    hits += [f"prefect record {text[:60]!r}" for text in texts for secret in lab.secrets if secret in text]
    files = sum(1 for p in lab.work.rglob("*") if p.is_file())
    return Outcome("Failed: " + "; ".join(hits[:5]) if hits else "Completed", rerun="-",
                   note=f"{len(lab.secrets)} secrets, {files} files and {len(texts)} Prefect records searched")


ROWS = [
    Row("baseline", "clean", "no fault: two hosts, two shards", "Completed", (), clean_run),
    Row("deploy", "put_fails", "workdir's parent is a file: the bundle put fails", "Failed",
        ("host h1", "not-a-dir"), deploy_put_fails),
    Row("deploy", "disk_full", "workdir on a 64 KiB tmpfs", "Failed", ("host lo", "KiB free on the disk"),
        deploy_disk_full),
    Row("deploy", "wrong_bundle", "the bundle arrives altered: wrong hash", "Failed",
        ("wrong bundle hash", "HASH MISMATCH", "nothing unpacked"), wrong_bundle),
    Row("launch", "no_output", "the worker prints nothing and never exits", "Failed",
        ("shard 0/1 on h1", "STARTED"), launch_fault("sleep 3600")),
    Row("launch", "exit_0", "the worker exits 0 at once, printing nothing", "Failed",
        ("shard 0/1 on h1", "exited at once"), launch_fault("exit 0"), fast=True),
    Row("launch", "no_interpreter", "the inventory's python does not exist", "Failed",
        ("host h1", "/nonexistent/python3"), launch_fault(python="/nonexistent/python3")),
    Row("launch", "import_error", "the worker dies on an ImportError", "Failed",
        ("shard 0/1 on h1", "ModuleNotFoundError"),
        launch_fault(f"exec {sys.executable} -c 'import hsx_missing_dependency'")),
    Row("launch", "log_unwritable", "worker.log cannot be created", "Failed",
        ("shard 0/1 on h1", "cannot create the worker log"),
        launch_fault(before=log_dir_unwritable)),
    Row("launch", "duplicate", "the same run launched twice at once", "Completed", (), duplicate_launch),
    Row("run", "kill9", "kill -9 of the worker mid-run", "Failed", ("shard 0/1 on h1", "lost"),
        signal_mid_run(signal.SIGKILL), fast=True),
    Row("run", "sigstop", "SIGSTOP of the worker mid-run", "Failed", ("shard 0/1 on h1", "stalled"),
        signal_mid_run(signal.SIGSTOP)),
    Row("run", "oom_kill", "the kernel OOM-kills the worker (memory cgroup)", "Failed",
        ("shard 0/1 on lo", "lost", "kernel oom_kill count 1"), oom_kill),
    Row("run", "cut_short", "host cut off for 2 s (host_timeout_s 5)", "Completed", (), cut_host(2)),
    Row("run", "cut_long", "host cut off for 20 s (host_timeout_s 5); re-run elsewhere", "Failed",
        ("shard 0/2 on h1", "host unreachable"), cut_host(20)),
    Row("run", "reboot", "host reboot: processes gone, sshd down 2 s, files kept", "Failed",
        ("shard 0/1 on h1",), reboot),
    Row("data", "bad_lines", "malformed, empty, assistant-less, over-long lines and a repeated id", "Completed",
        ("2 skipped with a reason",), bad_lines, fast=True),
    Row("data", "missing_weights", "the model dir lacks a weights file", "Failed", ("safetensors",),
        bad_input(model_missing_shard)),
    Row("data", "layer_out_of_range", "layers=1,99 on an 8-layer model", "Failed", ("99",),
        bad_input(lambda case: {"layers": "1,99"}), fast=True),
    Row("run", "out_disk_full", "the output disk fills up mid-run (3 MiB tmpfs), then grows", "Failed",
        ("shard 0/1 on lo", "No space left on device"), out_disk_full),
    Row("storage", "s3_5xx_burst", "six 503/500 answers to batch PUTs", "Completed", (), storage_fault(burst())),
    Row("storage", "s3_revoked", "credentials revoked (403) after 3 batch PUTs", "Failed", ("AccessDenied",),
        storage_fault(revoke_after(3)), fast=True),
    Row("storage", "s3_no_bucket", "the output bucket does not exist", "Failed",
        ("NoSuchBucket", "before any launch"),
        storage_fault(output_for=lambda store: "s3://hsx-no-such-bucket/run")),
    Row("storage", "s3_object_deleted", "a stored batch object deleted after the run", "Failed",
        ("missing",), object_deleted),
    Row("storage", "corrupt_spooled", "a spooled batch file altered before its upload", "Failed",
        ("sha256",), storage_fault(bandwidth=200_000, strike=corrupt_spooled)),
    Row("abuse", "secrets_at_rest", "keys of every storage row grepped for in all files and Prefect records",
        "Completed", (), secrets_at_rest),  # last: it searches what the rows before it left
]


def print_table(rows: list[tuple[Row, Outcome]], out=sys.stdout) -> None:
    head = ("group", "fault", "expected", "observed", "detect s", "lost", "dup", "left", "re-run", "pass")
    print("| " + " | ".join(head) + " |", file=out)
    print("|" + "|".join("---" for _ in head) + "|", file=out)
    for row, o in rows:
        seen = o.observed if len(o.observed) <= 90 else o.observed[:87] + "..."
        cells = (row.group, row.fault, row.expected, seen.replace("|", "/"),
                 "-" if o.detect_s is None else f"{o.detect_s:.1f}", str(o.lost), str(o.duplicated), str(o.left),
                 o.rerun[:40], "yes" if row.passed(o) else "**NO**")
        print("| " + " | ".join(cells) + " |", file=out)


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
        progress(f"{row.group}/{row.name}: {'pass' if row.passed(outcome) else 'FAIL'} in "
                 f"{time.monotonic() - began:.1f}s: {outcome}")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fast", action="store_true", help="only the rows CI runs")
    ap.add_argument("--only", help="comma-separated row names")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    rows = [r for r in ROWS if (not args.fast or r.fast) and (not args.only or r.name in args.only.split(","))]
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # here, not at import: the tests import this
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from moto.server import ThreadedMotoServer
    from prefect.testing.utilities import prefect_test_harness

    from sshhosts import SshdFarm

    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    work = Path(tempfile.mkdtemp(prefix="hsx-faults-"))
    model = tiny.build_model(work / "model", kind="qwen3_5_text")
    data = tiny.build_dataset(work / "chat.jsonl", 48, seed=7)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    began = time.monotonic()
    try:
        with SshdFarm() as farm, prefect_test_harness(server_startup_timeout=120):
            for name, netns in (("h1", True), ("h2", True), ("lo", False)):
                farm.add_host(name, netns=netns)
            host, port = moto.get_host_and_port()
            lab = Lab(work, farm, f"http://{host}:{port}", model, data)
            results = run_rows(lab, rows, progress=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        moto.stop()
    print(f"\nfault matrix: {len(results)} rows in {time.monotonic() - began:.0f}s, {os.cpu_count()} CPU cores, "
          f"hosts: sshd in network namespaces (h1, h2) and on loopback, {len(dataset_ids(data))} samples a short run, "
          f"{len(dataset_ids(lab.long_data))} a long one (rows that strike mid-run)\n")
    print_table(results)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            print_table(results, handle)
    return 0 if all(row.passed(o) for row, o in results) else 1


if __name__ == "__main__":
    sys.exit(main())
