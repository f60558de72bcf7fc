"""Task runs a dead flow run left Running: closed by the next run of the same `run_name`.

A flow-run process killed mid-run (kill -9, OOM, the orchestrating machine gone) cannot finish its task
runs: its flow run is marked Crashed (by its worker, or by the heartbeat automation) but its launch and
supervise task runs stay Running forever in the UI. The run that continues the same `run_name` adopts
their shards, so it also closes their books: each such task run is set Crashed, naming the flow run
that took over.
"""

from __future__ import annotations

from typing import Callable

#: states whose flow run will never report again: its task runs still Pending or Running are orphans
DEAD = ("CRASHED", "FAILED", "CANCELLED", "COMPLETED")


def close_orphaned_task_runs(client, run: str, run_name_of: Callable[[dict], str], current_flow_run_id,
                             flow_name: str = "extract", limit: int = 200) -> list[str]:
    """Set Crashed every Pending/Running task run of a finished (Crashed, Failed, ...) flow run of `flow_name`
    whose run name (`run_name_of(parameters)`) is `run`. Returns "task run name (flow run name)" per closed run."""
    from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId,
                                                FlowRunFilterState, FlowRunFilterStateType, TaskRunFilter,
                                                TaskRunFilterState, TaskRunFilterStateType)
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
