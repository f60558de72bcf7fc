"""Rows that fault the orchestrator as users run it: `prefect server start`, the `extract/qwen` deployment and
automations registered by deployments/qwen.py, and `prefect worker start`. The flow-run process, the worker,
both, or the server die mid-run while the shards are held alive at their first batch (harness.faulty's
HSX_HOLD_WHILE), so every fault lands at the same point of the run."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from .. import faulty
from .lab import FAST, Case, Lab, Outcome

from harness.prefect import flow_run_pid, wait_until

POOL = "hsextract-faults"


class Served:
    """A Prefect server of the matrix's own (a fixed port and SQLite file, so it can be restarted), the
    deployments and automations on it, and a process worker polling every second."""

    def __init__(self, lab: Lab):
        from deployments.local import PrefectServer

        self.root = lab.work / "served"
        self.root.mkdir(exist_ok=True)
        self.server = PrefectServer(self.root / "prefect").__enter__()
        self.worker = None
        with self.api():
            from deployments.qwen import register

            register(str(lab.model), str(lab.data), f"file://{self.root / 'out'}", str(self.root / "hosts.yaml"),
                     pool=POOL)  # every row passes its own model, data, output and hosts
        self.start_worker()

    def api(self):
        """Prefect clients made inside talk to this server."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        return temporary_settings(updates={PREFECT_API_URL: self.server.url})

    def start_worker(self) -> None:
        from deployments.local import start_worker

        self.worker = start_worker(POOL, self.server.env, self.root / "worker.log", query_s=1.0)

    def kill_worker(self) -> None:
        os.kill(self.worker.pid, signal.SIGKILL)  # the worker alone: its flow-run processes live on
        self.worker.wait()

    def stop_server(self) -> None:
        from deployments.local import stop

        stop(self.server.process)

    def start_server(self) -> None:
        self.server.__enter__()  # the same port and database

    def close(self) -> None:
        from deployments.local import stop

        stop(self.worker)
        self.stop_server()


def served(lab: Lab) -> Served:
    if lab.served is None:
        lab.served = Served(lab)
    return lab.served


class HeldRun:
    """A run of extract/qwen (two shards on `lo`) whose shards hold at their first batch until `release()`."""

    def __init__(self, lab: Lab, case: Case, stack: Served):
        from prefect.deployments import run_deployment

        self.case, self.stack = case, stack
        self.hold = case.base / "hold"
        self.hold.touch()
        python = faulty.python_for(case.base / "python-held", {faulty.HOLD_WHILE: str(self.hold)})
        self.params = {**FAST, "model": str(lab.model), "data": str(case.data), "output": case.local_out(),
                       "hosts": case.inventory(("lo",), gpus=(0, 1), lo={"python": python}),
                       "run_name": case.run_name, "layers": "1,3", "dtype": "auto", "token_budget": 128}
        with stack.api():
            self.run = run_deployment("extract/qwen", parameters=self.params, timeout=0)
        self.pids = {shard: case.wait_extracting("lo", shard, 2, timeout=120, files=0) for shard in (0, 1)}

    def release(self) -> None:
        self.hold.unlink(missing_ok=True)

    def read(self, flow_run_id=None):
        from prefect.client.orchestration import get_client

        with self.stack.api(), get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id or self.run.id)

    def wait(self, predicate, timeout: float, what: str):
        """`predicate()` once truthy (deployments.local.wait_until), naming this row and the worker's log."""
        return wait_until(predicate, timeout, f"{self.case.run_name}: {what}", interval=0.25,
                          context=lambda: f"see {self.stack.root / 'worker.log'}")

    def final(self, flow_run_id=None, timeout: float = 240):
        return self.wait(lambda: (lambda r: r if r.state and r.state.is_final() else None)(self.read(flow_run_id)),
                         timeout, "a final state")

    def rerun(self):
        """The run the automations started after this one (same run name), once it exists."""
        from harness.prefect import flow_runs_for
        from prefect.client.orchestration import get_client

        def other():
            with self.stack.api(), get_client(sync_client=True) as client:
                return [r for r in flow_runs_for(client, self.case.run_name, "qwen") if r.id != self.run.id]
        return self.wait(other, 120, "the automated re-run")[0]

    def workers(self) -> dict[int, int]:
        """Live worker pid per shard, from their control dirs."""
        live = {}
        for shard in (0, 1):
            with contextlib.suppress(OSError, ValueError):
                pid = int((self.case.control_dir("lo", shard, 2) / "pid").read_text())
                os.kill(pid, 0)
                live[shard] = pid
        return live

    def outcome(self, first, detect_s: float | None, rerun=None, note: str = "") -> Outcome:
        state = first.state
        seen = state.type.value.title() + (f": {state.message}" if state.message and not state.is_completed() else "")
        after = "-" if rerun is None else (rerun.state.type.value.title() + (
            f": {rerun.state.message}" if not rerun.state.is_completed() else ""))
        with self.stack.api():
            return self.case.finish(seen, detect_s, None, self.case.local_out(), rerun=after, note=note)

    def launched(self, flow_run_id) -> int:
        """Launch tasks of a flow run that ended Completed (a launch that adopts a live shard completes too)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with self.stack.api(), get_client(sync_client=True) as client:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return sum(1 for t in tasks if t.name.startswith("launch-") and t.state and t.state.is_completed())


def _crash_then_rerun(held: HeldRun, acted: float, wait_crash_s: float) -> tuple:
    """Wait for the run to be Crashed, then for the crash re-run to adopt both shards, release them, and wait
    for the re-run's end. Returns (first run, seconds to Crashed, re-run, note)."""
    first = held.wait(lambda: (lambda r: r if r.state and r.state.is_crashed() else None)(held.read()),
                      wait_crash_s, "the run to be marked Crashed")
    crashed_after = first.state.timestamp.timestamp() - acted
    rerun = held.rerun()
    held.wait(lambda: held.launched(rerun.id) == 2, 120, "the re-run's launches (adopting the held shards)")
    same = held.workers() == held.pids
    held.release()
    rerun = held.final(rerun.id)
    return first, crashed_after, rerun, (f"re-run adopted the same worker pids {sorted(held.pids.values())}"
                                         if same else f"workers changed: {held.workers()} vs {held.pids}")


def flow_process_killed(lab: Lab, case: Case) -> Outcome:
    stack = served(lab)
    held = HeldRun(lab, case, stack)
    os.kill(flow_run_pid(held.run.id), signal.SIGKILL)
    acted = time.time()
    first, seconds, rerun, note = _crash_then_rerun(held, acted, 60)
    return held.outcome(first, seconds, rerun, note)


def orchestrator_killed(lab: Lab, case: Case) -> Outcome:
    """The machine that orchestrates dies: worker and flow-run process at once, so nobody reports the run."""
    from deployments.qwen import ZOMBIE_AFTER

    stack = served(lab)
    held = HeldRun(lab, case, stack)
    stack.kill_worker()
    os.kill(flow_run_pid(held.run.id), signal.SIGKILL)
    acted = time.time()
    stack.start_worker()  # it comes back (systemd); the run it had is silent now
    first, seconds, rerun, note = _crash_then_rerun(held, acted, ZOMBIE_AFTER.total_seconds() + 60)
    return held.outcome(first, seconds, rerun, note)


def worker_killed(lab: Lab, case: Case) -> Outcome:
    """The Prefect worker alone dies: the flow-run process it started goes on and must finish the run."""
    stack = served(lab)
    held = HeldRun(lab, case, stack)
    stack.kill_worker()
    time.sleep(2)
    held.release()
    try:
        first = held.final()
    finally:
        stack.start_worker()
    return held.outcome(first, None, note="worker killed -9, restarted after the run ended")


def server_restarted(lab: Lab, case: Case) -> Outcome:
    """`prefect server` stops and starts again (same port and database) while the shards run."""
    stack = served(lab)
    held = HeldRun(lab, case, stack)
    began = time.monotonic()
    stack.stop_server()
    time.sleep(2)
    stack.start_server()
    down = time.monotonic() - began
    held.release()
    first = held.final()
    return held.outcome(first, None, note=f"server down {down:.0f}s (stopped, 2 s, started again)")

