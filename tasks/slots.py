"""Run a plan's shards on the GPU slots of the healthy hosts: one shard per slot at a time, until none is left.

Each shard has a driver thread (with the flow's context) that calls the launch task, then the supervise
task, directly: a failed launch raises in its driver, so no task is ever left Pending or NotReady, and
results never queue behind one scheduler thread. A slot that frees up takes the next shard; a shard that
last failed on some host goes to a slot on another host when one is free. Every state change goes to the
board (the attempt record, the UI, events).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextvars
import threading
import time
from collections import deque

from prefect import get_run_logger
from prefect.states import State

from hsextract.errors import Retry

from .board import Board
from .cancel import Cancel, signal_name
from .failures import NOT_LAUNCHED, Failure, one_line
from .monitor import HostPool
from .plan import Plan
from .shards import ShardFailed, ShardJob, ShardStopped, launch, remove_credentials_file, supervise


def run_shards(plan: Plan, healthy: set[str], board: Board, host_failures: dict[str, Failure] | None = None,
               cancel: Cancel | None = None, pool: HostPool | None = None) -> tuple[dict[int, str], dict[str, Failure]]:
    """Launch then supervise every shard of `plan.todo` on the slots of the `healthy` hosts (`host_failures`:
    why the others are not). Returns ({shard: "done" | "cancelled" | "stopped"}, {"shard N": its Failure}).

    A signal that reaches this (main) thread while shards run (Ctrl-C, SIGTERM: see tasks/cancel.py) begins
    `cancel`: the workers are told to stop on every host, the drivers end at their next look, then the
    signal goes on up to the flow."""
    todo = deque(plan.todo)
    free = deque(slot for slot in plan.slots if slot[0] in healthy)
    if not todo:
        return {}, {}
    if not free:
        hosts = list((host_failures or {}).values())
        why = f"{NOT_LAUNCHED} its deploy and preflight checks (see the host lines)"
        # only mistakes among the hosts' failures: a re-run cannot help
        retry = Retry.NEVER if hosts and all(f.retry is Retry.NEVER for f in hosts) else Retry.LATER
        for shard in todo:
            board.set_state(shard, "failed", why, retry)
        return {}, {f"shard {shard}": Failure("", one_line(why), retry=retry, shard=shard,
                                              num_shards=plan.num_shards) for shard in todo}
    driver = Driver(plan, board, first_wave=min(len(todo), len(free)), cancel=cancel, pool=pool)
    outcomes, failures = {}, {}
    active: dict[cf.Future, tuple[ShardJob, tuple[str, int]]] = {}
    with cf.ThreadPoolExecutor(max_workers=len(free), thread_name_prefix="shard") as executor:
        try:
            while (todo and not driver.cancelled) or active:
                while todo and free and not driver.cancelled:
                    shard = todo.popleft()
                    slot = take_slot(free, plan.attempts.get(shard).last_failed_host)
                    job = plan.job(slot, shard)
                    active[executor.submit(contextvars.copy_context().run, driver.drive, job)] = (job, slot)
                done, _ = cf.wait(list(active), return_when=cf.FIRST_COMPLETED)
                for future in done:
                    job, slot = active.pop(future)
                    free.append(slot)
                    try:
                        summary = future.result()
                        outcomes[job.shard] = summary if isinstance(summary, str) else "done"
                    except Exception as exc:  # the task's own error: host, shard, command, output
                        failures[f"shard {job.shard}"] = failure_of(job, exc)
        except BaseException as exc:
            if cancel is None or isinstance(exc, Exception):
                raise
            cancel.begin(f"{signal_name(exc)} reached the flow-run process")  # then the pool waits for drivers
            raise
    return outcomes, failures


def failure_of(job: ShardJob, exc: Exception) -> Failure:
    """The shard's `Failure` from its task's error (a ShardFailed carries one; anything else is its text)."""
    if isinstance(exc, ShardFailed):
        return exc.failure
    text = str(exc) or type(exc).__name__
    return Failure(job.host, one_line(text), f"{job.label}: {text}", shard=job.shard, num_shards=job.num_shards)


def take_slot(free: deque, avoid: str) -> tuple[str, int]:
    """The first free slot on a host other than `avoid` (where the shard last failed), else the first one."""
    for i, slot in enumerate(free):
        if slot[0] != avoid:
            del free[i]
            return slot
    return free.popleft()


class Driver:
    """Takes one shard through launch and supervise, telling the board every change of its state."""

    def __init__(self, plan: Plan, board: Board, first_wave: int, cancel: Cancel | None = None,
                 pool: HostPool | None = None):
        self.plan, self.board, self.first_wave, self.cancel, self.pool = plan, board, first_wave, cancel, pool
        self.started = time.monotonic()
        self.proved = 0
        self.lock = threading.Lock()
        self.log = get_run_logger()

    @property
    def cancelled(self) -> bool:
        """The run is being cancelled: no shard is launched any more."""
        return self.cancel is not None and self.cancel.event.is_set()

    def drive(self, job: ShardJob) -> dict | str:
        """The shard's summary when it is done, "cancelled" / "stopped" when it ended on purpose; its task's
        error otherwise (after the board heard of it)."""
        board, inventory, deadlines = self.board, self.plan.inventory, self.plan.deadlines
        phase = "launching"
        try:
            if self.cancelled:
                raise ShardStopped("cancelled", "the flow run is being cancelled: not launched")
            board.set_state(job.shard, "launching", host=job.host, gpu=job.gpu)
            launched = launch(job, inventory, deadlines, self.pool)
            board.set_state(job.shard, "running", "adopted" if launched.adopted else "launched", pid=launched.pid,
                            adopted=launched.adopted, seconds_to_proof=launched.seconds)
            self._proved()
            phase = "running"
            summary = supervise(job, launched, inventory, deadlines,
                                on_probe=lambda beat, age: board.beat(job.shard, beat, age),
                                cancel=self.cancel.event if self.cancel is not None else None, pool=self.pool)
            if isinstance(summary, State):  # the task run ended Cancelled: the shard was stopped on purpose
                raise ShardStopped.parse(summary.message or "")
            board.set_state(job.shard, "done", "complete", samples_done=summary.get("samples_done"))
            return summary
        except ShardStopped as stopped:  # on purpose: no failure, no attempt counted
            board.set_state(job.shard, stopped.kind, stopped.why)
            self.log.warning("%s %s: %s", job.label, stopped.kind, stopped.why)
            return stopped.kind
        except Exception as exc:
            failure = failure_of(job, exc)
            if self.cancelled:  # its launch or worker killed by the cancel's stop: no failure, no attempt counted
                why = f"the flow run was cancelled while this shard was {phase}: {failure.why}"
                board.set_state(job.shard, "cancelled", why)
                self.log.warning("%s cancelled: %s", job.label, why)
                return "cancelled"
            board.set_state(job.shard, "failed", failure.why, failure.retry)
            self.log.error("%s failed: %s%s", job.label, failure.why,
                           " (not retried: a re-run cannot fix this)" if failure.retry is Retry.NEVER else "")
            raise
        finally:
            try:
                remove_credentials_file(job, inventory, pool=self.pool)
            except Exception as exc:  # the verdict stands; say the file may still be there
                self.log.warning("%s: credentials file %s may remain on the host: %s", job.label,
                                 job.options.aws_credentials_file, exc)

    def _proved(self) -> None:
        with self.lock:
            self.proved += 1
            if self.proved == self.first_wave:
                self.log.info("all %d shard(s) of the first wave verified running, %.1fs after the first launch",
                              self.first_wave, time.monotonic() - self.started)
