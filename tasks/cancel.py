"""Stopping a run's workers on purpose: the flow run was cancelled, or one shard is stopped by hand.

Workers are detached on their hosts (they outlive the orchestrator by design), so a stop goes to the hosts:
`stop_workers` sends each host of the inventory, in parallel, one command (`stop_cmd`) that writes the
stop request beside each live worker of the run (its stop.json: the worker names it in its exit record),
SIGTERMs it (the file in flight is finished and journaled), and leaves a sleeper on the host that SIGKILLs
whatever is still running after the grace: the grace holds even if the orchestrator is gone a moment later.
Then, while it may, it watches the workers end.

The run's marks, beside its attempt record in the output (`_runs/<run>/`):
  cancelled.json   the run was cancelled ({"time", "by", "why"}): automated runs of it (re-runs, the
                   scheduled re-run) are held until a person starts it again, which clears the mark
  stopped.json     shards stopped on purpose ({"<shard>": {"time", "why"}}): automated runs leave them out
                   until a person's run, which clears them
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hsextract.errors import Retry
from hsextract.store import Store

from .commands import alive_cmd, stop_cmd
from .hosts import HostError, connect
from .inventory import Inventory
from .settings import DEFAULT

CANCELLED_KEY = "_runs/{run}/cancelled.json"
STOPPED_KEY = "_runs/{run}/stopped.json"


@dataclass
class HostStop:
    """What one host said to a stop: the workers signalled (shard dir -> pid), those still alive at the end
    of the watch, or why the host could not be told."""

    host: str
    signalled: dict[str, int] = field(default_factory=dict)
    alive: dict[str, int] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0

    def describe(self) -> str:
        if self.error:
            return f"host {self.host}: not stopped: {self.error}"
        if not self.signalled:
            return f"host {self.host}: no live worker of the run"
        ended = sorted(set(self.signalled) - set(self.alive))
        text = f"host {self.host}: SIGTERM to {len(self.signalled)} worker(s), {len(ended)} ended"
        if self.alive:
            text += f"; still running: {', '.join(f'{d} (pid {p})' for d, p in sorted(self.alive.items()))}"
        return text + f" ({self.seconds:.1f}s)"


def stop_workers(inventory: Inventory, run: str, kind: str, why: str, grace_s: float,
                 shards: list[int] | None = None, wait_s: float | None = None,
                 timeout_s: float = 30.0) -> list[HostStop]:
    """Stop the workers of `run` (`shards` only, else every one it has) on every host of
    `inventory`, in parallel: stop request `kind` ("cancelled" | "stopped") saying `why`, SIGTERM, SIGKILL
    after `grace_s` on the host. Then watch them end for up to `wait_s` (None: the grace + 10 s; 0: not at
    all). Never raises for a host: an unreachable one says so in its `HostStop`."""
    request = {"stop": kind, "why": why, "time": round(time.time(), 3), "grace_s": grace_s}
    wait_s = grace_s + 10.0 if wait_s is None else wait_s

    def one(spec) -> HostStop:
        began = time.monotonic()
        result = HostStop(spec.name)
        try:
            with connect(spec, inventory) as host:
                said = host.run(stop_cmd(spec.workdir, run, request, grace_s, shards), timeout_s)
                for line in said.stdout.splitlines():
                    words = line.split()
                    if len(words) == 3 and words[0] == "TERM" and words[2].isdigit():
                        result.signalled[words[1]] = int(words[2])
                if not said.ok or "STOP SENT" not in said.stdout and "NO RUN DIR" not in said.stdout:
                    result.error = f"the stop command failed: {said.describe()}"
                    return result
                result.alive = dict(result.signalled)
                deadline = began + wait_s
                while result.alive and time.monotonic() < deadline:
                    time.sleep(0.5)
                    check = host.run(alive_cmd(spec.workdir, run, sorted(result.alive)), timeout_s)
                    if check.ok and "CHECKED" in check.stdout:
                        result.alive = {w[1]: int(w[2]) for w in (line.split() for line in check.stdout.splitlines())
                                        if len(w) == 3 and w[0] == "ALIVE"}
        except HostError as exc:
            result.error = str(exc)
        finally:
            result.seconds = time.monotonic() - began
        return result

    with ThreadPoolExecutor(max_workers=max(1, min(64, len(inventory.hosts))), thread_name_prefix="stop") as pool:
        return list(pool.map(one, inventory.hosts))


def mark_cancelled(store: Store, run: str, by: str, why: str) -> None:
    """Record that run `run` was cancelled: automated runs of it are held until a person starts it."""
    store.write(CANCELLED_KEY.format(run=run), json.dumps({"time": round(time.time(), 3), "by": by, "why": why},
                                                          indent=1).encode())


def cancelled_mark(store: Store, run: str) -> dict | None:
    """The run's cancelled mark, None when it has none."""
    try:
        return json.loads(store.read(CANCELLED_KEY.format(run=run)))
    except FileNotFoundError:
        return None


def clear_cancelled(store: Store, run: str) -> None:
    store.delete(CANCELLED_KEY.format(run=run))


def mark_stopped(store: Store, run: str, shards: list[int], why: str) -> None:
    """Record shards stopped on purpose: automated runs leave them out until a person's run."""
    def change(data: bytes | None) -> bytes:
        marks = json.loads(data) if data else {}
        for shard in shards:
            marks[str(shard)] = {"time": round(time.time(), 3), "why": why}
        return json.dumps(marks, indent=1).encode()

    store.update(STOPPED_KEY.format(run=run), change)


def stopped_marks(store: Store, run: str) -> dict[int, dict]:
    """Shards of the run stopped on purpose: {shard: {"time", "why"}}."""
    try:
        return {int(k): v for k, v in json.loads(store.read(STOPPED_KEY.format(run=run))).items()}
    except FileNotFoundError:
        return {}


def clear_stopped(store: Store, run: str) -> None:
    store.delete(STOPPED_KEY.format(run=run))


#: what reaches the flow-run process when its run is cancelled: Ctrl-C (a direct call), SIGTERM (Prefect's
#: runner or worker asking the process to stop, or anyone's kill), both raised in its main thread
def cancel_signals() -> tuple[type[BaseException], ...]:
    from prefect.exceptions import TerminationSignal

    return KeyboardInterrupt, TerminationSignal


class Cancel:
    """A run's cancellation, once it began: `event` tells its shard drivers to stop launching and supervising
    at once; `begin` SIGTERMs the run's workers on every host without waiting (a Prefect worker kills this
    process soon after it signalled it); `finish`, once no driver can launch any more, stops again (a launch in
    flight may have started one since) and watches them end."""

    def __init__(self, run: str, inventory: Inventory, grace_s: float, log, by: str = ""):
        self.run, self.inventory, self.grace_s, self.log, self.by = run, inventory, grace_s, log, by
        self.event = threading.Event()
        self.why = ""
        self.stops: list[HostStop] = []

    def begin(self, why: str) -> None:
        if self.event.is_set():
            return
        self.why = why
        self.event.set()
        self.log.warning("run %s: cancelled (%s): stopping its workers on %d host(s)", self.run, why,
                         len(self.inventory.hosts))
        self.stops = stop_workers(self.inventory, self.run, "cancelled", self._request(), self.grace_s, wait_s=0)

    def finish(self, wait_s: float) -> list[HostStop]:
        self.begin(self.why or "cancelled")
        first = {stop.host: stop for stop in self.stops}
        self.stops = stop_workers(self.inventory, self.run, "cancelled", self._request(), self.grace_s,
                                  wait_s=wait_s)
        for stop in self.stops:  # a worker the first stop signalled may have ended before this one looked
            if stop.host in first:
                stop.signalled = {**first[stop.host].signalled, **stop.signalled}
        for stop in self.stops:
            (self.log.warning if stop.error or stop.alive else self.log.info)("run %s: %s", self.run, stop.describe())
        return self.stops

    def _request(self) -> str:
        return f"run {self.run} cancelled" + (f" ({self.by})" if self.by else "") + f": {self.why}"


def flow_run_label() -> str:
    """`flow run <name> (<id>)` of the flow run this is in ("" outside one)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    return f"flow run {run.name} ({run.id})" if run is not None else ""


def started_by_automation(rerun_depth: int) -> str:
    """What started this flow run when no person did (an automated re-run, the re-run schedule, an
    automation), "" when a person did (the UI, `prefect deployment run`, a direct call)."""
    from prefect.context import FlowRunContext

    if rerun_depth:
        return f"automated re-run {rerun_depth}"
    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    if run is None:
        return ""
    if run.auto_scheduled:
        return "its deployment's schedule"
    try:
        from prefect.runtime import deployment

        if (deployment.name or "").endswith("-rerun"):  # extract/qwen-rerun: the scheduled re-run, however started
            return f"deployment extract/{deployment.name}"
    except Exception:  # no deployment, or the server would not say: a person's run
        pass
    created = getattr(run, "created_by", None)
    if created is not None and str(getattr(created, "type", "")).upper() == "AUTOMATION":
        return f"automation {getattr(created, 'display_value', '') or created.id}"
    return ""


def hold_if_cancelled(plan, log):
    """A run of a cancelled run_name: held (a Cancelled state to return) when an automation or schedule
    started it; a person's run clears the mark and the stopped-shard marks, and goes on (None)."""
    from prefect.states import Cancelled

    if not plan.reachable():
        return None
    mark = cancelled_mark(plan.store, plan.run)
    if mark is None:
        return None
    automated = started_by_automation(plan.settings.retries.rerun_depth)
    if automated:
        why = (f"run {plan.run}: held: it was cancelled ({mark.get('why', '?')}); started by {automated}, "
               f"not by a person: nothing launched. Start it by hand to resume it")
        log.warning(why)
        return Cancelled(message=why)
    # workers of the cancelled run still going (a host that was unreachable then): stopped, not adopted
    grace = plan.settings.deadlines.cancel_grace_s
    for stop in stop_workers(plan.inventory, plan.run, "cancelled", f"left running by the cancelled run {plan.run}",
                             grace, wait_s=grace + 10.0):
        if stop.signalled or stop.error:
            log.warning("run %s: before resuming: %s", plan.run, stop.describe())
        if stop.alive:
            raise RuntimeError(f"run {plan.run}: workers of its cancelled run still run after {grace + 10:g}s: "
                               f"{stop.describe()}")
    clear_cancelled(plan.store, plan.run)
    log.info("run %s: was cancelled (%s); started by hand: resuming it", plan.run, mark.get("why", "?"))
    return None


SIGNAL_NAMES = {"KeyboardInterrupt": "SIGINT (Ctrl-C)", "TerminationSignal": "SIGTERM"}


def signal_name(exc: BaseException) -> str:
    """How a cancel's signal is named: SIGINT (Ctrl-C), SIGTERM (Prefect's runner or worker, or a kill)."""
    return SIGNAL_NAMES.get(type(exc).__name__, type(exc).__name__)


def cancelled(plan, board, cancel: Cancel | None, exc: BaseException, log):
    """End a run that a signal cancelled: its workers stopped on every host (watched until they end, within
    the grace + 10 s, or less where Prefect's runner will kill this process), the shards not done marked
    cancelled (no attempt counted), the run marked cancelled in its output, `extract.run.cancelled`; the
    Cancelled state to return."""
    import os

    from prefect.states import Cancelled

    from .rerun import announce

    name = signal_name(exc)
    if plan is None or cancel is None:
        return Cancelled(message=f"cancelled by {name} before the run was planned: nothing was launched")
    cancel.begin(f"{name} reached the flow-run process")
    # a runner-managed flow-run process is killed 30 s after its SIGTERM: end before that
    runner = os.environ.get("PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS", "true").lower() == "false"
    stops = cancel.finish(min(cancel.grace_s + 10.0, 20.0) if runner else cancel.grace_s + 10.0)
    signalled = sum(len(s.signalled) for s in stops)
    left = [f"{s.host}: {', '.join(sorted(s.alive))}" for s in stops if s.alive]
    unreached = [f"{s.host} ({s.error.split(' (so `')[0]})" for s in stops if s.error]  # the logs hold the command
    if board is not None:
        for shard, row in sorted(board.rows.items()):
            if row.state not in ("done", "complete", "capped", "cancelled", "stopped"):
                board.set_state(shard, "cancelled", cancel.why)
    try:
        if plan.reachable():
            mark_cancelled(plan.store, plan.run, cancel.by, cancel.why)
    except Exception as error:  # the hosts were told; say that automated runs may not be held
        log.warning("run %s: cancelled, but the mark that holds automated re-runs was not written: %s", plan.run,
                    error)
    what = (f"run {plan.run} cancelled ({name}): {signalled} worker(s) told to stop"
            + (f"; still running (SIGKILL on the host after {cancel.grace_s:g}s): {'; '.join(left)}" if left else
               "; all ended" if signalled else "")
            + (f"; not reached: {'; '.join(unreached)} (stopped by the next run of {plan.run})" if unreached else "")
            + ". Automated re-runs are held: start it again by hand to resume it")
    if board is not None:
        board.finish("cancelled")
    announce(plan.run, "cancelled", what)
    log.warning(what)
    return Cancelled(message=what)


def stop_on_cancellation(flow, flow_run, state) -> None:
    """Prefect's `on_cancellation` hook of `extract`: where the runner or worker owns the cancel, it runs in
    that process once the flow-run process is gone, so it stops the run's workers even when the flow-run
    process was killed before it could (the flow itself stops them first whenever it can: a second stop is
    harmless). Never raises: a hook's error would only hide the cancel."""
    import logging

    from hsextract.store import open_store

    from .credentials import load_access
    from .plan import reachable, resolve_inventory
    from .settings import Settings

    log = logging.getLogger("hsextract.cancel")
    try:
        settings = Settings.from_stored(flow_run.parameters or {})
        run, job = settings.job.run, settings.job
        inventory = resolve_inventory(job.hosts)
        grace = settings.deadlines.cancel_grace_s
        for stop in stop_workers(inventory, run, "cancelled", f"run {run} cancelled (flow run {flow_run.name})",
                                 grace, wait_s=0):
            log.warning("run %s: on cancellation: %s", run, stop.describe())
        store = open_store(job.output, client=load_access(job.aws_credentials).client)
        if reachable(store, inventory) and cancelled_mark(store, run) is None:
            mark_cancelled(store, run, f"flow run {flow_run.name} ({flow_run.id})", "cancelled")
    except Exception as exc:
        log.error("flow run %s: cancelled, but its workers may still run: %s: %s", flow_run.name,
                  type(exc).__name__, exc)


def hold_stopped_shards(plan, log) -> dict[int, str]:
    """Shards stopped on purpose (`stop_shards`): an automated run leaves them out (returned: shard -> why,
    and named in `plan.failures`, not retried); a person's run clears the marks and runs them."""
    from .failures import Failure

    if not plan.reachable():
        return {}
    marks = stopped_marks(plan.store, plan.run)
    if not marks:
        return {}
    automated = started_by_automation(plan.settings.retries.rerun_depth)
    if not automated:
        clear_stopped(plan.store, plan.run)
        log.info("run %s: shard(s) %s were stopped on purpose; started by hand: running them", plan.run,
                 ", ".join(map(str, sorted(marks))))
        return {}
    held = {}
    for shard in [s for s in plan.todo if s in marks]:
        plan.todo.remove(shard)
        why = f"stopped on purpose ({marks[shard].get('why') or 'no reason given'}): not run by {automated}; " \
              f"a run started by hand runs it again"
        plan.failures[f"shard {shard}"] = Failure("", why, retry=Retry.NEVER, shard=shard, num_shards=plan.num_shards)
        held[shard] = plan.stopped[shard] = why
    return held


def stop_shards(hosts: str, output: str, run: str, shards: list[int], why: str, aws_credentials: str | None = None,
                grace_s: float = DEFAULT.cancel_grace_s) -> list[HostStop]:
    """Stop shards of a run on purpose, without cancelling the run: mark them stopped beside the attempt
    record (automated runs leave them out until a person's run), then stop their workers wherever they run.
    The flow run supervising them names them stopped and ends Failed, asking for no re-run of them."""
    from hsextract.store import open_store

    from .credentials import load_access
    from .plan import reachable, resolve_inventory

    inventory = resolve_inventory(hosts)
    store = open_store(output, client=load_access(aws_credentials).client)
    if not reachable(store, inventory):
        raise RuntimeError(f"{output}: not reachable from here, so the stop could not be recorded (automated runs "
                           f"would start the shards again): run this where the output is visible")
    mark_stopped(store, run, shards, why)
    return stop_workers(inventory, run, "stopped", why, grace_s, shards=shards)


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.cancel stop --hosts H --output O --run-name R --shard N [--shard M] [--why TEXT]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tasks.cancel", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="stop shards of a run on purpose (the run is not cancelled)")
    stop.add_argument("--hosts", required=True, help="the inventory (YAML path or HostInventory block name)")
    stop.add_argument("--output", required=True, help="the run's output (file:///... or s3://...)")
    stop.add_argument("--run-name", required=True)
    stop.add_argument("--shard", type=int, action="append", required=True, dest="shards")
    stop.add_argument("--why", default="stopped by hand")
    stop.add_argument("--aws-credentials", default=None, help="the AwsCredentials block of an s3:// output")
    stop.add_argument("--grace", type=float, default=DEFAULT.cancel_grace_s,
                      help=f"seconds from SIGTERM to SIGKILL (default {DEFAULT.cancel_grace_s:g})")
    args = parser.parse_args(argv)
    stops = stop_shards(args.hosts, args.output, args.run_name, args.shards, args.why, args.aws_credentials,
                        args.grace)
    for s in stops:
        print(s.describe())
    return 1 if any(s.error or s.alive for s in stops) else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
