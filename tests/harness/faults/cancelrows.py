"""Rows that cancel a run (issue 19): by each path Prefect delivers a cancel (`prefect flow-run cancel` of a run
executed by `prefect worker start` or served by `extract.serve()`, SIGINT or SIGTERM on a direct call), and at
each point of a run (deploying, launching, extracting, uploading to S3, with one host unreachable).

Each row runs against the matrix's own Prefect server with the deployments and automations users register
(orchestrator.Served), cancels once its point is reached, and measures: cancel -> the run Cancelled, cancel ->
no worker process of the run left on any host, flow runs anything started in the minute after the cancel
(goal 0), failed attempts the cancel counted (goal 0); then a person's run of the same run_name resumes it
(every sample exactly once). A row whose figure misses its goal is observed as Failed, naming it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .lab import FAST, Case, Lab, Outcome
from .orchestrator import Served, served
from .storagerows import Store

from harness.prefect import flow_runs_for, wait_until
from harness.worker import running

GRACE_S = 30.0     # cancel_grace_s of every row: the goal is no worker within it + 10 s (15 s when it honours SIGTERM)
WATCH_S = 60.0     # after the cancel, nothing may start a flow run for this long
ROOT = Path(__file__).resolve().parents[3]


class CancelRun:
    """One run of `extract` on this row's hosts, started by `path`, cancelled by it, and watched."""

    def __init__(self, lab: Lab, case: Case, stack: Served, path: str, layout: dict[str, int], **params):
        self.lab, self.case, self.stack, self.path = lab, case, stack, path
        self.layout = layout                    # host name -> shards it runs (one GPU each)
        self.num_shards = sum(layout.values())
        self.params = {**FAST, "model": str(lab.model), "data": str(case.data), "run_name": case.run_name,
                       "output": case.local_out(), "layers": "1,3", "cancel_grace_s": GRACE_S, "token_budget": 128,
                       **params}
        self.process: subprocess.Popen | None = None   # the direct call, or the serve process
        self.log = case.base / f"{path}.log"
        self.flow_run_id = None
        self.asked = 0.0                                # wall time of the cancel

    def env(self) -> dict:
        return {**os.environ, **self.stack.server.env,
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}

    def start(self) -> None:
        from prefect.deployments import run_deployment

        if self.path in ("sigint", "sigterm"):  # a person's `extract(...)` in a terminal
            code = "import json, sys; from flows.extract import extract; extract(**json.loads(sys.argv[1]))"
            self.process = subprocess.Popen([sys.executable, "-c", code, json.dumps(self.params)], cwd=ROOT,
                                            env=self.env(), stdout=self.log.open("w"), stderr=subprocess.STDOUT)
            return
        name = "qwen"
        if self.path == "served":
            name = f"served-{self.case.run_name.replace('_', '-')}"
            self.process = subprocess.Popen(
                [sys.executable, "-c", f"from flows.extract import extract; extract.serve(name={name!r}, limit=2)"],
                cwd=ROOT, env=self.env(), stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        with self.stack.api():
            run = wait_until(lambda: self._try(run_deployment, f"extract/{name}"), 120,
                             f"{self.case.run_name}: the deployment extract/{name}", interval=1,
                             context=self.said)
        self.flow_run_id = run.id

    def _try(self, run_deployment, name: str):
        try:
            return run_deployment(name, parameters=self.params, timeout=0)
        except Exception:  # noqa: BLE001 - a served deployment not registered yet
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"{self.path} process ended: {self.said()}") from None
            return None

    def said(self) -> str:
        text = self.log.read_text()[-2000:] if self.log.exists() else ""
        return text + f"\n(worker log: {self.stack.root / 'worker.log'})"

    def read(self):
        from prefect.client.orchestration import get_client

        with self.stack.api(), get_client(sync_client=True) as client:
            if self.flow_run_id is None:  # a direct call: its flow run, once created
                runs = flow_runs_for(client, self.case.run_name)
                if not runs:
                    return None
                self.flow_run_id = runs[-1].id
            return client.read_flow_run(self.flow_run_id)

    def cancel(self) -> None:
        self.asked = time.time()
        if self.path in ("sigint", "sigterm"):
            self.process.send_signal(signal.SIGINT if self.path == "sigint" else signal.SIGTERM)
            return
        proc = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", str(self.flow_run_id)],
                              env=self.env(), capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"prefect flow-run cancel: {proc.stdout}{proc.stderr}")

    def control_dirs(self) -> list[Path]:
        dirs, shard = [], 0
        for host, n in self.layout.items():
            dirs += [self.case.control_dir(host, shard + i, self.num_shards) for i in range(n)]
            shard += n
        return dirs

    def workers(self) -> dict[str, int]:
        """Live worker pid per control dir (host/shard)."""
        live = {}
        for control in self.control_dirs():
            with contextlib.suppress(OSError, ValueError):
                pid = int((control / "pid").read_text())
                if running(pid):
                    live[f"{control.parent.parent.parent.name}/{control.name}"] = pid
        return live

    def exits(self) -> list[str]:
        """Each shard's exit record, short: code, stop kind, and for an upload its last words."""
        said = []
        for control in self.control_dirs():
            try:
                record = json.loads((control / "exit.json").read_text())
            except (OSError, ValueError):
                said.append(f"{control.name}: none")
                continue
            tail = record.get("reason", "").rpartition("; ")[2] if "uploaded" in record.get("reason", "") else ""
            said.append(f"{control.name}: {record.get('code')} {record.get('stop') or ''}"
                        + (f" ({tail})" if tail else ""))
        return said

    def final(self, timeout: float = 180):
        return wait_until(lambda: (lambda r: r if r and r.state and r.state.is_final() else None)(self.read()),
                          timeout, f"{self.case.run_name}: the cancelled run's final state", interval=0.2,
                          context=self.said)

    def started_since(self, since: float) -> list:
        """Flow runs of any deployment created on the server after wall time `since`."""
        import datetime as dt

        from prefect.client.orchestration import get_client

        after = dt.datetime.fromtimestamp(since, dt.timezone.utc)
        with self.stack.api(), get_client(sync_client=True) as client:  # created, not started: a held one counts
            runs = client.read_flow_runs(limit=200)
        return [r for r in runs if r.created and r.created > after and r.id != self.flow_run_id]

    def failed_attempts(self) -> int:
        from hsextract.store import open_store

        with contextlib.suppress(FileNotFoundError):
            store = open_store(self.params["output"], self.client)
            attempts = json.loads(store.read(f"_runs/{self.case.run_name}/attempts.json"))
            return sum(a.get("failed_attempts", 0) for a in attempts.values())
        return 0

    client = None  # the S3 client of a row on s3://

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM) if self.path == "served" else self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)


def _wait(what: str, predicate, timeout: float, run: CancelRun):
    return wait_until(predicate, timeout, f"{run.case.run_name}: {what}", interval=0.05, context=run.said)


def cancel_row(path: str, at: str):
    """A row: a run started by `path` ("worker" | "served" | "sigint" | "sigterm") cancelled at `at`
    ("extracting" | "deploy" | "launch" | "uploading" | "unreachable")."""
    def run(lab: Lab, case: Case) -> Outcome:
        stack = served(lab)
        case.data = lab.long_data
        hold = case.base / "hold"
        store = None
        extra: dict = {}
        layout = {"h1": 1, "h2": 1}
        if at in ("deploy", "launch"):  # an interpreter that holds at that step while `hold` exists
            hold.touch()
            step = "--version" if at == "deploy" else "extract"
            py = case.base / "python-held"  # passes deploy's checks: it execs the real one in the end
            py.write_text(f"#!/bin/sh\nif [ \"$3\" = {step} ] && [ -e {hold} ]; then touch {case.base}/reached; "
                          f"while [ -e {hold} ]; do sleep 0.1; done; fi\nexec {sys.executable} \"$@\"\n")
            py.chmod(0o755)
            extra["hosts"] = case.inventory(("h1", "h2"), h1={"python": str(py)}, h2={"python": str(py)})
        elif at == "uploading":  # a slow link to S3 (the proxy listens on this machine's loopback: host lo)
            with stack.api():  # its credentials block on the server the runs read it from
                store = Store(lab, case, bandwidth=40_000)
            layout = {"lo": 2}
            extra.update(hosts=case.inventory(("lo",), gpus=(0, 1)), output=store.output,
                         aws_credentials=store.block)
        elif at == "unreachable":  # h1's worker held mid-run (alive until the hold goes), h2's runs
            from .. import faulty

            hold.touch()
            py = faulty.python_for(case.base / "python-held", {faulty.HOLD_WHILE: str(hold)})
            extra["hosts"] = case.inventory(("h1", "h2"), h1={"python": py})
        else:
            extra["hosts"] = case.inventory(("h1", "h2"))
        cancel = CancelRun(lab, case, stack, path, layout, **extra)
        cancel.client = store.client if store else None
        notes = []
        try:
            cancel.start()
            _strike(at, cancel, store)
            before = cancel.workers()
            cancel.cancel()
            first = cancel.final()
            to_cancelled = first.state.timestamp.timestamp() - cancel.asked
            expect_left = {k for k in before if k.startswith("w-h1/")} if at == "unreachable" else set()
            _wait("no worker left (but the unreachable host's)", lambda: set(cancel.workers()) <= expect_left or None,
                  GRACE_S + 30, cancel)
            to_idle = time.time() - cancel.asked
            notes.append("exit records: " + ", ".join(cancel.exits()))
            if at == "unreachable":
                left = cancel.workers()
                notes.append(f"h1 cut at the cancel: its worker {'still runs' if left else 'ended!'} "
                             f"({', '.join(left) or '-'}), h2's stopped")
            time.sleep(max(0.0, cancel.asked + WATCH_S - time.time()))
            started = cancel.started_since(cancel.asked)
            failed = cancel.failed_attempts()
            if cancel.process is not None and cancel.path != "served":
                cancel.process.wait(timeout=30)
            if at == "unreachable":
                lab.farm.restore("h1")  # it comes back; its worker is still held (its hold goes after the row)
            else:
                hold.unlink(missing_ok=True)
            if store:
                store.heal()
            goals = []
            if not first.state.is_cancelled():
                goals.append(f"ended {first.state.type.value}")
            if to_idle > GRACE_S + 10:
                goals.append(f"workers left {to_idle:.0f}s after the cancel")
            if started:
                goals.append(f"{len(started)} flow run(s) started in {WATCH_S:.0f}s: "
                             f"{[(r.name, r.state.type.value if r.state else '?') for r in started]}")
            if failed:
                goals.append(f"the cancel counted {failed} failed attempt(s)")
            message = " ".join((first.state.message or "").split())
            seen = f"Failed: {'; '.join(goals)}" if goals else f"Cancelled: {message}"
            notes.insert(0, f"cancel -> Cancelled {to_cancelled:.1f}s, -> no worker {to_idle:.1f}s; "
                            f"flow runs started in {WATCH_S:.0f}s: {len(started)}; failed attempts counted: {failed}")
            rerun = {**{k: v for k, v in extra.items() if k != "output"}, "cancel_grace_s": GRACE_S,
                     "token_budget": 128}
            watch = None
            if at == "unreachable":  # h1's worker, still held: the person's run must stop it (a SIGKILL after
                rerun["hosts"] = case.inventory(("h1", "h2"), tag="fixed")  # the grace); its relaunch not held
                watch = _Death(cancel.workers().get("w-h1/shard-00000-of-00002"))
            with stack.api():
                outcome = case.finish(seen, to_cancelled, rerun, extra.get("output", case.local_out()),
                                      client=cancel.client, note="; ".join(notes))
            if watch is not None:
                outcome.note += "; " + watch.say()
            return outcome
        finally:
            with contextlib.suppress(Exception):
                lab.farm.restore("h1")
            hold.unlink(missing_ok=True)
            cancel.close()
            if store:
                store.close()
    return run


def _strike(at: str, cancel: CancelRun, store) -> None:
    """Wait for the point of the run at which this row cancels."""
    case = cancel.case
    if at in ("deploy", "launch"):
        _wait(f"the run to reach its {at}", lambda: (case.base / "reached").exists() or None, 180, cancel)
        return
    if at == "unreachable":
        case.wait_extracting("h1", 0, 2, timeout=180, files=0)  # held at its first batch
        case.wait_extracting("h2", 1, 2, timeout=60)
        cancel.lab.farm.cut("h1")
        return
    if at == "uploading":
        spool = case.control_dir("lo", 0, 2) / "spool" / "shard-00000-of-00002"

        def backlog():
            stored = sum(1 for method, path in store.proxy.seen if method == "PUT" and "/batch-" in path)
            return stored >= 1 and len(list(spool.glob("batch-*.safetensors"))) >= 3 or None
        _wait("uploads under way with a backlog in the spool", backlog, 180, cancel)
        return
    for i, host in enumerate(cancel.layout):
        case.wait_extracting(host, i, 2, timeout=180)


class _Death:
    """When a process ends, watched from now on."""

    def __init__(self, pid: int | None):
        import threading

        self.pid, self.since, self.ended = pid, time.time(), None
        if pid is not None and running(pid):
            threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while running(self.pid):
            time.sleep(0.1)
        self.ended = time.time()

    def say(self) -> str:
        if self.pid is None:
            return "h1's worker was gone before the run by hand: nothing to stop!"
        if self.ended is None:
            return f"h1's worker pid {self.pid} STILL RUNS after the run by hand!"
        return f"h1's worker pid {self.pid} stopped by the run by hand, {self.ended - self.since:.0f}s after it began"
