"""Task runs a dead flow run left Running: closed by the next run of the same `run_name`.

A flow-run process killed mid-run (kill -9, OOM, the orchestrating machine gone) cannot finish its task
runs: its flow run is marked Crashed (by its worker, or by the heartbeat automation) but its launch and
supervise task runs stay Running forever in the UI. The run that continues the same `run_name` adopts
their shards, so it also closes their books: each such task run is set Crashed, naming the flow run
that took over.
"""

from __future__ import annotations

from collections.abc import Callable

from .settings import run_name_of

#: states whose flow run will never report again: its task runs still Pending or Running are orphans
DEAD = ("CRASHED", "FAILED", "CANCELLED", "COMPLETED")


def close_orphaned_task_runs(client, run: str, run_name_of: Callable[[dict], str], current_flow_run_id,
                             flow_name: str = "extract", limit: int = 200) -> list[str]:
    """Set Crashed every Pending/Running task run of a finished (Crashed, Failed, ...) flow run of `flow_name`
    whose run name (`run_name_of(parameters)`) is `run`. Returns "task run name (flow run name)" per closed run."""
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.states import Crashed

    dead = client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType[name] for name in DEAD]))),
        sort=FlowRunSort.START_TIME_DESC, limit=limit)
    mine = [r for r in dead if r.id != current_flow_run_id and run_name_of(r.parameters or {}) == run]
    if not mine:
        return []
    orphans = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in mine])),
        task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(
            any_=[StateType.PENDING, StateType.RUNNING]))))
    names = {r.id: r.name for r in mine}
    closed = []
    for task_run in orphans:
        owner = names.get(task_run.flow_run_id, "?")
        client.set_task_run_state(task_run.id, Crashed(
            message=f"flow run {owner} ended without finishing this task (its process died); flow run "
                    f"{current_flow_run_id} continues run {run} and adopts the shard"), force=True)
        closed.append(f"{task_run.name} ({owner})")
    return closed


def close_orphans(run: str, log) -> None:
    """Close the books of earlier runs of `run` whose process died (inside a flow run; never raises): their task
    runs left Running are set Crashed, since this run adopts their shards."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    try:
        with get_client(sync_client=True) as client:
            closed = close_orphaned_task_runs(
                client, run, run_name_of,
                ctx.flow_run.id if ctx and ctx.flow_run else None)
    except Exception as exc:  # bookkeeping: never a reason to stop the run
        log.warning("run %s: could not close the task runs earlier runs left Running: %s", run, exc)
        return
    if closed:
        log.info("run %s: set Crashed %d task run(s) a dead earlier run left Running: %s", run, len(closed),
                 ", ".join(closed))
