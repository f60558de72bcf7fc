"""Cancel means stop: a cancelled `extract` stops every worker it started, ends Cancelled, holds automated
re-runs, and a later run by hand resumes it, every sample exactly once. A real Prefect server, real workers of
the tiny model on the local host, a dataset long enough to be cancelled mid-run.

(Through `prefect worker start` and `prefect flow-run cancel`: tests/integration/test_deployment.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import hsextract
from hsextract import tiny

from harness.inventory import write_inventory
from harness.worker import dataset_ids

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(heartbeat_interval_s=0.5, poll_interval_s=0.3, launch_timeout_s=30, stall_timeout_s=20,
            host_timeout_s=10, token_budget=256, status_interval_s=1.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tiny.build_dataset(tmp_path_factory.mktemp("canceldata") / "chat.jsonl", 320, seed=11)


def params(tiny_model, data, tmp_path: Path, run: str, **extra) -> dict:
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0, 1],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    return {"model": str(tiny_model), "data": str(data), "output": f"file://{tmp_path / 'out'}",
            "hosts": str(hosts), "layers": "1,3", "run_name": run, **FAST, **extra}


def workers(tmp_path: Path, run: str) -> dict[str, dict]:
    """Per shard dir of the run on the local host: its pid, whether that process still runs (not a zombie),
    and its exit record."""
    found = {}
    for control in sorted((tmp_path / "w" / "runs" / run).glob("shard-*")):
        try:
            pid = int((control / "pid").read_text())
        except (OSError, ValueError):  # being launched
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
        except OSError:
            state = None
        exit_file = control / "exit.json"
        found[control.name] = {"pid": pid, "alive": state not in (None, "Z"),
                               "exit": json.loads(exit_file.read_text()) if exit_file.exists() else None}
    return found


def flow_run_of(run: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs() if (r.parameters or {}).get("run_name") == run]
    return max(runs, key=lambda r: r.created)


def task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_direct_call_that_is_signalled_stops_its_workers_ends_cancelled_and_resumes(
        prefect_server, tiny_model, data, tmp_path, signame):
    from prefect.settings import PREFECT_API_URL

    from flows.extract import extract

    run = f"cancel-{signame.lower()}"
    p = params(tiny_model, data, tmp_path, run)
    code = "import json, sys; from flows.extract import extract; extract(**json.loads(sys.argv[1]))"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    caller = subprocess.Popen([sys.executable, "-c", code, json.dumps(p)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (len(w := workers(tmp_path, run)) == 2 and all(x["alive"] for x in w.values()) and all(
            (tmp_path / "w" / "runs" / run / d / "heartbeat.json").exists() and json.loads(
                (tmp_path / "w" / "runs" / run / d / "heartbeat.json").read_text()).get("samples_done", 0) > 0
            for d in w)):
        assert caller.poll() is None and time.monotonic() < deadline, caller.communicate()[0][-3000:]
        time.sleep(0.2)
    signalled = time.monotonic()
    caller.send_signal(getattr(signal, signame))
    said = caller.communicate(timeout=120)[0]
    ended = time.monotonic() - signalled
    left = workers(tmp_path, run)
    assert not any(w["alive"] for w in left.values()), left
    assert ended < 15, f"the flow-run process took {ended:.1f}s to end after {signame}"
    for shard, w in left.items():  # each worker finished its file in flight and said why it stopped
        assert w["exit"] and w["exit"]["stop"] == "cancelled" and w["exit"]["code"] == 143, (shard, w)
    flow_run = flow_run_of(run)
    state = flow_run.state
    assert state.is_cancelled(), (state, said[-3000:])
    tasks = task_runs(flow_run.id)
    assert not [t.name for t in tasks if t.state.is_running() or t.state.is_pending()], tasks
    supervised = {t.name: (t.state.type.value, t.state.message) for t in tasks if t.name.startswith("supervise")}
    assert len(supervised) == 2 and all(kind == "CANCELLED" and message.startswith("cancelled: ")
                                        for kind, message in supervised.values()), supervised
    assert "2 worker(s) told to stop; all ended" in state.message and "start it again by hand" in state.message
    out = tmp_path / "out"
    mark = json.loads((out / "_runs" / run / "cancelled.json").read_text())
    assert signame in mark["why"]
    record = out / "_runs" / run / "attempts.json"  # written once something is recorded
    attempts = json.loads(record.read_text()) if record.exists() else {}
    assert all(a["failed_attempts"] == 0 for a in attempts.values()), "a cancel is not a failed attempt"

    if signame != "SIGINT":
        return  # the rest is the same whichever signal it was
    held = extract(return_state=True, **{**p, "rerun_depth": 1})  # what an automation would start
    assert held.is_cancelled() and "held" in held.message and "automated re-run 1" in held.message, held.message
    assert not any(w["alive"] for w in workers(tmp_path, run).values())

    again = extract(return_state=True, **p)  # a person starts it again: it resumes
    assert again.is_completed(), again.message
    assert not (out / "_runs" / run / "cancelled.json").exists(), "a run by hand clears the mark"
    ids = Counter(s["id"] for s in hsextract.read_samples(out, verify=True))
    assert ids == Counter(dataset_ids(data)), "every sample exactly once after the cancel"
