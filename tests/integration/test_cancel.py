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
from harness.worker import dataset_ids, running

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(heartbeat_interval_s=0.5, poll_interval_s=0.3, launch_timeout_s=30, stall_timeout_s=20,
            host_timeout_s=10, token_budget=256, status_interval_s=1.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tiny.build_dataset(tmp_path_factory.mktemp("canceldata") / "chat.jsonl", 320, seed=11)


def ctrl_c_heard() -> None:
    """In the caller's child, before it runs: SIGINT back to its default, as in a terminal where a person presses
    Ctrl-C. A suite started in the background (`... &` from a script) inherits SIGINT ignored, and Python then
    never raises KeyboardInterrupt: the run would go on as if no one had asked it to stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def slow_python(tmp_path: Path) -> str:
    """The worker on a slow GPU (every forward pass 0.25 s longer: harness.faulty): a shard runs for ~15 s
    however fast this machine is, so a cancel always finds it mid-run."""
    from harness.faulty import FORWARD_DELAY_S, python_for

    return python_for(tmp_path / "python-slow", {FORWARD_DELAY_S: "0.25"})


def params(tiny_model, data, tmp_path: Path, run: str, python: str | None = None, **extra) -> dict:
    python = python or slow_python(tmp_path)
    hosts = write_inventory(tmp_path / f"hosts-{Path(python).name}.yaml",
                            [{"name": "local", "hostname": "local", "gpus": [0, 1], "workdir": str(tmp_path / "w"),
                              "python": python}])
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
        exit_file = control / "exit.json"
        found[control.name] = {"pid": pid, "alive": running(pid),
                               "exit": json.loads(exit_file.read_text()) if exit_file.exists() else None}
    return found


def extracting(tmp_path: Path, run: str) -> bool:
    """Both workers of the run alive and past their first sample."""
    def done(control: Path) -> int:
        try:
            return json.loads((control / "heartbeat.json").read_text()).get("samples_done", 0)
        except (OSError, ValueError):
            return 0

    found = workers(tmp_path, run)
    return len(found) == 2 and all(w["alive"] and done(tmp_path / "w" / "runs" / run / d) > 0
                                   for d, w in found.items())


def logged_at(said: str, text: str, near: float) -> float:
    """When the first line of a Prefect console log holding `text` was logged (its HH:MM:SS.mmm, local time, on
    the day that puts it nearest to `near`); inf when no line holds it."""
    import datetime as dt

    for line in said.splitlines():
        stamp = line.split(" | ", 1)[0]
        if text in line and len(stamp) == 12:
            day = dt.datetime.fromtimestamp(near).date()
            at = dt.datetime.combine(day, dt.time.fromisoformat(stamp)).timestamp()
            return min((at - 86400, at, at + 86400), key=lambda t: abs(t - near))
    return float("inf")


def flow_run_of(run: str):
    from harness.prefect import session_client

    with session_client() as client:
        runs = [r for r in client.read_flow_runs() if (r.parameters or {}).get("run_name") == run]
    return max(runs, key=lambda r: r.created)


def task_runs(flow_run_id) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from harness.prefect import session_client

    with session_client() as client:
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
    log = tmp_path / "caller.log"  # a file, not a pipe: nobody reads a pipe while the run goes on
    caller = subprocess.Popen([sys.executable, "-c", code, json.dumps(p)], cwd=ROOT, env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=ctrl_c_heard)
    deadline = time.monotonic() + 120
    while not extracting(tmp_path, run):
        assert caller.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    signalled, signalled_at = time.monotonic(), time.time()
    caller.send_signal(getattr(signal, signame))
    caller.wait(timeout=120)
    ended = time.monotonic() - signalled
    said = log.read_text()
    left = workers(tmp_path, run)
    assert not any(w["alive"] for w in left.values()), left
    # what this project does within seconds: the workers end, and the run's verdict is logged; what follows the
    # verdict is Prefect's (the state sent, its logs and events flushed at exit): bounded below the grace, the
    # SIGKILL nobody waited for
    logs = "\n".join(f"{d}: {(tmp_path / 'w' / 'runs' / run / d / 'worker.log').read_text()[-1500:]}" for d in left)
    why = (f"{signame} sent at {signalled_at:.3f}, the process ended {ended:.1f}s later; workers {left}\n"
           f"{said[-6000:]}\n{logs}")
    worker_ends = [w["exit"]["time"] - signalled_at for w in left.values() if w["exit"]]
    assert len(worker_ends) == 2 and max(worker_ends) < 15, why
    assert logged_at(said, f"run {run} cancelled (", signalled_at) - signalled_at < 15, why
    assert ended < 60, why
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

    # a person starts it again (at the usual speed: nothing need find it mid-run any more): it resumes
    again = extract(return_state=True, **params(tiny_model, data, tmp_path, run, python=sys.executable))
    assert again.is_completed(), again.message
    assert not (out / "_runs" / run / "cancelled.json").exists(), "a run by hand clears the mark"
    ids = Counter(s["id"] for s in hsextract.read_samples(out, verify=True))
    assert ids == Counter(dataset_ids(data)), "every sample exactly once after the cancel"


def test_a_cancel_while_the_workers_are_launched_kills_them_and_counts_no_attempt(prefect_server, tiny_model, data,
                                                                                  tmp_path):
    """SIGINT while both launches wait for their workers (an interpreter that holds before it runs the worker):
    the stop kills what was launched, the launches that fail of it count no failed attempt, the run ends
    Cancelled, and a run by hand (no hold) does it all, every sample once."""
    from prefect.settings import PREFECT_API_URL

    from flows.extract import extract

    run, hold, reached = "cancel-launch", tmp_path / "hold", tmp_path / "reached"
    hold.touch()
    held = tmp_path / "python-held"
    held.write_text(f"#!/bin/sh\nif [ \"$3\" = extract ]; then touch {reached}; while [ -e {hold} ]; do sleep 0.1; "
                    f"done; fi\nexec {slow_python(tmp_path)} \"$@\"\n")
    held.chmod(0o755)
    p = params(tiny_model, data, tmp_path, run, python=str(held))
    code = "import json, sys; from flows.extract import extract; extract(**json.loads(sys.argv[1]))"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "caller.log"
    caller = subprocess.Popen([sys.executable, "-c", code, json.dumps(p)], cwd=ROOT, env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=ctrl_c_heard)
    try:
        deadline = time.monotonic() + 120
        while len(workers(tmp_path, run)) < 2 or not reached.exists():
            assert caller.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        caller.send_signal(signal.SIGINT)
        caller.wait(timeout=120)
    finally:
        hold.unlink()
    said = log.read_text()
    assert not any(w["alive"] for w in workers(tmp_path, run).values()), (workers(tmp_path, run), said[-3000:])
    state = flow_run_of(run).state
    assert state.is_cancelled(), (state, said[-3000:])
    record = tmp_path / "out" / "_runs" / run / "attempts.json"
    attempts = json.loads(record.read_text()) if record.exists() else {}
    assert all(a["failed_attempts"] == 0 for a in attempts.values()), attempts
    again = extract(return_state=True, **params(tiny_model, data, tmp_path, run, python=sys.executable))
    assert again.is_completed(), again.message
    ids = Counter(s["id"] for s in hsextract.read_samples(tmp_path / "out", verify=True))
    assert ids == Counter(dataset_ids(data))


def test_a_served_deployment_cancelled_stops_its_workers_and_ends_cancelled(prefect_server, tiny_model, data,
                                                                             tmp_path):
    """`extract.serve()` (the runner in-process: no work pool, no worker) and `prefect flow-run cancel`."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL

    run = "cancel-served"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "serve.log"
    server = subprocess.Popen([sys.executable, "-c", "from flows.extract import extract; "
                               "extract.serve(name='served-cancel', limit=2)"], cwd=ROOT, env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    said = lambda: log.read_text()[-3000:]  # noqa: E731
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                flow_run = run_deployment("extract/served-cancel", parameters=params(tiny_model, data, tmp_path, run),
                                          timeout=0)
                break
            except Exception:  # the deployment is not registered yet
                assert server.poll() is None and time.monotonic() < deadline, said()
                time.sleep(1)
        while not extracting(tmp_path, run):
            assert server.poll() is None and time.monotonic() < deadline, said()
            time.sleep(0.2)
        asked = time.monotonic()
        cancel = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", str(flow_run.id)], env=env,
                                capture_output=True, text=True, timeout=60)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        while not flow_run_of(run).state.is_final():
            assert time.monotonic() - asked < 60, (flow_run_of(run).state, said())
            time.sleep(0.3)
        state = flow_run_of(run).state
        while any(w["alive"] for w in workers(tmp_path, run).values()):
            assert time.monotonic() - asked < 40, workers(tmp_path, run)
            time.sleep(0.3)
        assert state.is_cancelled(), (state, said())
        assert all(w["exit"] and w["exit"].get("stop") == "cancelled" for w in workers(tmp_path, run).values())
        assert (tmp_path / "out" / "_runs" / run / "cancelled.json").exists()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_one_shard_stopped_by_hand_fails_the_run_naming_it_and_only_a_person_runs_it_again(
        prefect_server, tiny_model, data, tmp_path):
    """`python -m tasks.cancel stop --shard 1` while the run goes on (a host must be given back): shard 1's
    worker stops (its file journaled), the run ends Failed naming it as stopped, with no failed attempt and
    no re-run of it; an automated run leaves it out; a run by hand runs it, every sample exactly once."""
    import threading

    from flows.extract import extract

    run = "stop-one"
    p = params(tiny_model, data, tmp_path, run)
    ended = {}
    first = threading.Thread(target=lambda: ended.setdefault("state", extract(return_state=True, **p)))
    first.start()
    deadline = time.monotonic() + 120
    while not extracting(tmp_path, run):
        assert first.is_alive() and time.monotonic() < deadline, ended
        time.sleep(0.2)
    stop = subprocess.run([sys.executable, "-m", "tasks.cancel", "stop", "--hosts", p["hosts"], "--output",
                           p["output"], "--run-name", run, "--shard", "1", "--why", "host given back"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0 and "SIGTERM to 1 worker(s), 1 ended" in stop.stdout, stop.stdout + stop.stderr
    first.join(timeout=300)
    state = ended["state"]
    assert state.is_failed() and "shard 1/2" in state.message and "stopped" in state.message, state.message
    assert "re-run requested" not in state.message and "cannot fix" not in state.message, state.message
    assert state.message.startswith(f"run {run}: shard(s) 1 stopped on purpose: not re-run until a person"), \
        state.message
    exits = {d: w["exit"] for d, w in workers(tmp_path, run).items()}
    assert exits["shard-00001-of-00002"]["stop"] == "stopped" and exits["shard-00000-of-00002"]["code"] == 0
    record = tmp_path / "out" / "_runs" / run / "attempts.json"
    attempts = json.loads(record.read_text()) if record.exists() else {}
    assert all(a["failed_attempts"] == 0 for a in attempts.values()), attempts

    held = extract(return_state=True, **{**p, "rerun_depth": 1, "shards": [1]})  # what an automation starts
    assert held.is_failed() and "stopped on purpose (host given back)" in held.message, held.message
    assert not any(w["alive"] for w in workers(tmp_path, run).values())

    again = extract(return_state=True, **params(tiny_model, data, tmp_path, run, python=sys.executable))
    assert again.is_completed(), again.message
    ids = Counter(s["id"] for s in hsextract.read_samples(tmp_path / "out", verify=True))
    assert ids == Counter(dataset_ids(data))
