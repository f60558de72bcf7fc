"""Reading a Prefect server the way the tests and benchmarks must: wait for a condition, the project's events
of a run, the flow runs of a run name, and the process that executes a flow run on this machine."""

from __future__ import annotations

import atexit
import contextlib
import time
from pathlib import Path

_session_clients: dict = {}


@contextlib.contextmanager
def session_client():
    """A sync client of the session's Prefect server (tests/conftest.py's `prefect_server`), opened once per process
    and kept open: a new client costs ~20 ms of CPU (its SSL context), and a test polling a run for minutes opens
    hundreds. Only for that server, which outlives every test; a server a test starts and stops needs its own."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    client = _session_clients.get(url)
    if client is None:
        client = _session_clients[url] = get_client(sync_client=True).__enter__()
        atexit.register(client.__exit__, None, None, None)
    yield client


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5, context=lambda: ""):
    """`predicate()` once it is truthy; AssertionError naming `what` (and `context()`) after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{context()}")


def run_events(client, prefix: str, run_name: str) -> list:
    """Events named `prefix`* whose payload is about `run_name` (extract.shard.*, extract.run.*), oldest first."""
    from prefect.events.filters import EventFilter, EventNameFilter

    found, page = [], client.read_events(EventFilter(event=EventNameFilter(prefix=[prefix])), limit=50)
    while page is not None:
        found += [e for e in page.events if e.payload.get("run_name") == run_name]
        page = client.read_events_page(page.next_page) if page.next_page else None
    return sorted(found, key=lambda e: e.occurred)


def flow_runs_for(client, run_name: str, deployment: str | None = None) -> list:
    """Flow runs whose `run_name` parameter is `run_name` (of deployment `deployment` if given), oldest first."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    found = client.read_flow_runs(limit=200, deployment_filter=DeploymentFilter(
        name=DeploymentFilterName(any_=[deployment])) if deployment else None)
    return sorted((r for r in found if (r.parameters or {}).get("run_name") == run_name), key=lambda r: r.created)


def flow_run_pid(flow_run_id) -> int:
    """The pid of the process executing a flow run on this machine: a worker starts a Prefect module there
    (`python -m prefect.engine`, or a supervisor that execs it) with the id in its environment. Not merely the
    first process with that environment: its children inherit it (the extraction workers a local host
    launches too, detached), and once pids wrap around one of them can come first."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        mine = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ
        if mine and any(a.startswith(b"prefect.") for a in argv):
            found.append(int(proc.name))
    if len(found) != 1:
        raise LookupError(f"flow run {flow_run_id}: {len(found)} processes of Prefect's on this machine run it "
                          f"({sorted(found)}), expected one")
    return found[0]


def shard_table(run_name: str) -> dict[int, dict]:
    """{shard: row} of the latest version of a run's shard table artifact (what the UI shows)."""
    import json

    from prefect.artifacts import Artifact

    from tasks.board import table_key

    artifact = Artifact.get(table_key(run_name))
    assert artifact is not None, f"no shard status table for {run_name}"
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    return {row["shard"]: row for row in rows}


def prefect_records(flow_run_id) -> str:
    """Everything Prefect kept about a flow run, as text: logs, artifacts, task and flow run states."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId,
                                                LogFilter, LogFilterFlowRunId)

    with get_client(sync_client=True) as client:
        logs, page = [], LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        while batch := client.read_logs(page, limit=200, offset=len(logs)):  # every page, not the first 200
            logs += batch
        runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        tasks = client.read_task_runs(flow_run_filter=runs)
        flow_run = client.read_flow_run(flow_run_id)
        # filtered: an unfiltered read stops at the server's page size (200) and would skip this run's
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    parts = [log.message for log in logs]
    parts += [json.dumps(a.data, default=str) + (a.description or "") for a in artifacts]
    parts += [f"{t.name} {t.state.message if t.state else ''}" for t in tasks]
    parts += [json.dumps(flow_run.parameters, default=str), flow_run.state.message or ""]
    return "\n".join(parts)
