"""`extract/qwen` through a real Prefect server, a real process worker and the project's automations.

The deployments and automations are registered with deployments/qwen.py (what users run), the flow runs
are started with `prefect deployment run` or the API, and a real `prefect worker start` executes them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

import hsextract
from hsextract import tiny
from hsextract.run.layers import dflash_layer_ids

from harness import faulty
from harness.inventory import write_inventory
from harness.prefect import session_client as client
from harness.worker import dataset_ids

POOL = "hsextract-test"
FAST = {"heartbeat_interval_s": 0.5, "poll_interval_s": 0.3, "launch_timeout_s": 30, "stall_timeout_s": 30,
        "host_timeout_s": 10, "status_interval_s": 1.0, "token_budget": 1024}
ZOMBIE_AFTER = timedelta(seconds=40)  # flow-run heartbeats every 30 s (Prefect's minimum)


class Served:
    def __init__(self, root: Path, env: dict, data: Path, model: Path):
        from deployments.local import start_worker

        self.root, self.env, self.data, self.model = root, env, data, model
        self._start_worker = start_worker
        self.worker = None
        self.start_worker()

    def start_worker(self):
        self.worker = self._start_worker(POOL, self.env, self.root / "worker.log", query_s=1.0)

    def stop_worker(self):
        from deployments.local import stop

        stop(self.worker)

    def inventory(self, name: str, python: str | None = None, gpus=(0, 1)) -> str:
        return str(write_inventory(self.root / f"{name}.yaml", [
            {"name": "local", "hostname": "local", "gpus": list(gpus), "workdir": str(self.root / f"w-{name}"),
             "python": python or sys.executable}]))

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "prefect", *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **self.env}, stdin=subprocess.DEVNULL)

    def worker_log(self) -> str:
        return (self.root / "worker.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def served(prefect_server, tiny_model, tmp_path_factory):
    from prefect.settings import PREFECT_API_URL

    from deployments.qwen import AUTOMATIONS, register

    root = tmp_path_factory.mktemp("served")
    data = tiny.build_dataset(root / "chat.jsonl", 96, seed=5)
    env = {"PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    hosts = str(write_inventory(root / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0, 1],
                                                       "workdir": str(root / "w"), "python": sys.executable}]))
    done = register(str(tiny_model), str(data), f"file://{root / 'out'}", hosts, pool=POOL, overrides=FAST,
                    zombie_after=ZOMBIE_AFTER)
    assert set(done["deployments"]) == {"qwen", "qwen-rerun", "qwen-preflight"} and set(done["automations"]) == set(AUTOMATIONS)
    served = Served(root, env, data, tiny_model)
    yield served
    served.stop_worker()
    from prefect.automations import Automation

    for name in AUTOMATIONS:  # the rest of the session runs flows without them
        Automation.read(name=name).delete()


def runs_of(run_name: str) -> list:
    """Flow runs of extract/qwen for `run_name`, oldest first."""
    from harness.prefect import flow_runs_for

    with client() as c:
        return flow_runs_for(c, run_name, "qwen")


def wait_final(flow_run_id, timeout: float = 240, served: Served | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with client() as c:
            run = c.read_flow_run(flow_run_id)
        if run.state and run.state.is_final():
            return run
        time.sleep(0.5)
    raise AssertionError(f"flow run {flow_run_id} not final after {timeout}s: {run.state}\n"
                         + (served.worker_log() if served else ""))


def wait_for(predicate, timeout: float, what: str, served: Served | None = None):
    from harness.prefect import wait_until

    return wait_until(predicate, timeout, what, context=served.worker_log if served else lambda: "")


def start(run_name: str, **parameters):
    from prefect.deployments import run_deployment

    return run_deployment("extract/qwen", parameters={"run_name": run_name, **parameters}, timeout=0)


def task_names(flow_run_id) -> set[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {t.name for t in tasks}


def events(prefix: str, run_name: str) -> list:
    from harness.prefect import run_events

    with client() as c:
        return run_events(c, prefix, run_name)


def table(run_name: str) -> dict[int, dict]:
    from harness.prefect import shard_table

    return shard_table(run_name)


def silent_python(tmp: Path, shard: int, once: bool) -> str:
    """An interpreter that passes deploy's checks but, asked to extract `shard`, exits 0 printing nothing."""
    mark = tmp / f"failed-once-{shard}"
    guard = f' && [ ! -e {mark} ]' if once else ""
    wrapper = tmp / f"python-silent-{shard}-{'once' if once else 'always'}"
    wrapper.write_text("#!/bin/sh\n"
                       f"case \" $* \" in *\" extract \"*\" --shard {shard} \"*) true{guard} "
                       f"&& {{ {'touch ' + str(mark) + '; ' if once else ''}exit 0; }} ;; esac\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def test_prefect_deployment_run_watch_completes_with_the_recipe(served):
    proc = served.cli("deployment", "run", "extract/qwen", "--watch", "--param", "run_name=cli", timeout=400)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{served.worker_log()}"
    assert "Completed" in proc.stdout
    samples = list(hsextract.read_samples(served.root / "out", verify=True))
    assert Counter(s["id"] for s in samples) == Counter(dataset_ids(served.data))
    assert {str(s["hidden_states"].dtype) for s in samples} == {"torch.bfloat16"}  # the recipe's bf16
    from safetensors import safe_open

    with safe_open(str(next((served.root / "out").glob("shard-*/*.safetensors"))), "pt") as batch:
        assert json.loads(batch.metadata()["layer_ids"]) == dflash_layer_ids(8, 5)  # dflash:5, 8-layer tiny model
    rows = table("cli")
    assert {r["state"] for r in rows.values()} == {"done"} and sum(int(r["samples"].split("/")[0])
                                                                   for r in rows.values()) == 96


def test_the_scheduled_rerun_deployment_launches_nothing_when_the_run_is_complete(served):
    from prefect.deployments import run_deployment

    with client() as c:
        deployment = c.read_deployment_by_name("extract/qwen-rerun")
    assert [s.active for s in deployment.schedules] == [False], "paused unless --rerun-every is given"
    assert deployment.parameters["layers"] == "dflash:5" and deployment.parameters["max_length"] == 4096
    run = run_deployment("extract/qwen-rerun", parameters={"run_name": "cli"}, timeout=0)
    run = wait_final(run.id, served=served)
    assert run.state.is_completed(), run.state
    assert not any(n.startswith(("launch-", "deploy-")) for n in task_names(run.id)), task_names(run.id)
    assert {r["state"] for r in table("cli").values()} == {"complete"}


def test_a_bad_parameter_is_rejected_before_a_run_exists(served):
    before = len(runs_of("bad"))
    for param, name in (("token_budget=-5", "token_budget"), ("layers=1;touch /tmp/pwned", "layers"),
                        ("dtype=int3", "dtype"), ("output=ftp://x/y", "output")):
        proc = served.cli("deployment", "run", "extract/qwen", "--param", "run_name=bad", "--param", param)
        assert proc.returncode != 0, proc.stdout
        assert name in proc.stdout + proc.stderr, (param, proc.stdout, proc.stderr)
    assert len(runs_of("bad")) == before
    assert not Path("/tmp/pwned").exists()


def test_a_silently_failing_shard_is_rerun_alone_by_the_automation(served):
    out = served.root / "out-flaky"
    hosts = served.inventory("flaky", python=silent_python(served.root, shard=1, once=True))
    first = wait_final(start("flaky", output=f"file://{out}", hosts=hosts).id, served=served)
    assert first.state.is_failed()
    with client() as c:
        message = str(c.read_flow_run(first.id).state.message)
    assert "shard 1" in message and "re-run of shard(s) [1] requested" in message, message
    runs = wait_for(lambda: [r for r in runs_of("flaky") if r.id != first.id], 60, "the automated re-run", served)
    rerun = wait_final(runs[0].id, served=served)
    assert rerun.state.is_completed(), (rerun.state, served.worker_log())
    assert rerun.parameters["shards"] == [1] and rerun.parameters["rerun_depth"] == 1
    assert rerun.parameters["token_budget"] == FAST["token_budget"], "every parameter is passed on"
    names = task_names(rerun.id)
    assert "launch-shard-1" in names and "launch-shard-0" not in names, names
    ids = Counter(s["id"] for s in hsextract.read_samples(out, verify=True))
    assert ids == Counter(dataset_ids(served.data))

    # the view: table, progress artifacts, events
    rows = table("flaky")
    assert rows[0]["state"] == "done", "the re-run of shard 1 keeps shard 0's row: the table stays whole"
    assert rows[1]["state"] == "done" and rows[1]["failed_attempts"] == 1 and rows[1]["last_failed_host"] == "local"
    assert "exited at once, printing no STARTED line" in rows[1]["last_error"]
    from prefect.artifacts import Artifact

    for shard in (0, 1):
        progress = Artifact.get(f"progress-flaky-{shard:05d}")
        assert progress is not None and float(progress.data) == 100.0, (shard, progress)
    failed = events("extract.shard.failed", "flaky")
    assert [e.payload["shard"] for e in failed] == [1] and failed[0].resource["hsextract.host"] == "local"
    assert "printing no STARTED line" in failed[0].payload["reason"]
    expected = {("extract.shard.launching", 0): 1, ("extract.shard.running", 0): 1, ("extract.shard.done", 0): 1,
                ("extract.shard.launching", 1): 2, ("extract.shard.failed", 1): 1, ("extract.shard.running", 1): 1,
                ("extract.shard.done", 1): 1}  # the events persister writes in batches: wait for them
    kinds = wait_for(lambda: (lambda k: k if k == expected else None)(
        Counter((e.event, e.payload["shard"]) for e in events("extract.shard.", "flaky"))), 30,
        f"events {expected}", served)
    assert kinds == expected
    asked = events("extract.run.incomplete", "flaky")
    assert len(asked) == 1 and asked[0].payload["rerun"] == [1]
    delay = (rerun.start_time - failed[0].occurred).total_seconds()
    print(f"\nshard failure -> automated re-run running: {delay:.1f}s")


def test_the_attempt_cap_stops_a_shard_that_always_fails(served):
    hosts = served.inventory("doomed", python=silent_python(served.root, shard=0, once=False), gpus=[0])
    first = wait_final(start("doomed", output=f"file://{served.root / 'out-doomed'}", hosts=hosts,
                             max_attempts=2).id, served=served)
    assert first.state.is_failed()
    second = wait_final(wait_for(lambda: [r for r in runs_of("doomed") if r.id != first.id], 60,
                                 "the automated re-run", served)[0].id, served=served)
    assert second.state.is_failed() and second.parameters["rerun_depth"] == 1
    with client() as c:
        message = str(c.read_flow_run(second.id).state.message)
    assert "no re-run requested: shard(s) [0] are at the attempt cap" in message, message
    time.sleep(5)
    assert len(runs_of("doomed")) == 2, "no third run: the cap ended the chain"
    # by hand, same run: refused without launching anything, and the table says why
    third = wait_final(start("doomed", output=f"file://{served.root / 'out-doomed'}", hosts=hosts,
                             max_attempts=2).id, served=served)
    with client() as c:
        message = str(c.read_flow_run(third.id).state.message)
    assert third.state.is_failed() and "attempt cap reached: failed 2 time(s)" in message, message
    assert not any(n.startswith("launch-") for n in task_names(third.id))
    row = table("doomed")[0]
    assert row["state"] == "capped" and row["failed_attempts"] == 2
    assert "printing no STARTED line" in row["last_error"] and "printing no STARTED line" in message


def _shard_workers(out: Path) -> Counter:
    """Live `hsextract extract` processes writing to `out`, per shard index."""
    found = Counter()
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"extract" in argv and str(out).encode() in argv and b"--shard" in argv:
            found[int(argv[argv.index(b"--shard") + 1])] += 1
    return found


def _shards_told(workdir: Path, served: Served) -> str:
    """What each shard's worker left (exit record, its log's end) and the Prefect worker's log: for a message."""
    told = []
    for shard in sorted(workdir.glob("runs/*/shard-*")):
        exit_file, log = shard / "exit.json", shard / "worker.log"
        told.append(f"{shard.name}: exit {exit_file.read_text() if exit_file.exists() else None}; log ends "
                    f"{log.read_text()[-600:] if log.exists() else None}")
    return "\n".join(told) + f"\nthe Prefect worker's log ends: {served.worker_log()[-1500:]}"


def test_orchestrator_killed_midrun_is_marked_crashed_and_the_rerun_adopts(served):
    from harness.prefect import flow_run_pid

    out = served.root / "out-phoenix"
    hold = served.root / "hold-phoenix"
    hold.touch()  # the shards wait at their first batch, alive and heartbeating, until the test lets go
    held = faulty.python_for(served.root / "python-held-phoenix", {faulty.HOLD_WHILE: str(hold)})
    hosts = served.inventory("phoenix", python=held)
    flow_run = start("phoenix", output=f"file://{out}", hosts=hosts, token_budget=256)
    wait_for(lambda: {e.payload["shard"] for e in events("extract.shard.running", "phoenix")} == {0, 1}, 120,
             "both shards verified running", served)
    pids = {e.payload["shard"]: e.payload["pid"] for e in events("extract.shard.running", "phoenix")}
    # the whole orchestrator dies at once: the worker first (so nobody reports the flow run), then the run
    os.kill(served.worker.pid, signal.SIGKILL)
    served.worker.wait()
    os.kill(flow_run_pid(flow_run.id), signal.SIGKILL)
    killed_at = time.monotonic()
    served.start_worker()  # the orchestrator comes back; the run it had is silent now
    most = Counter()

    def crashed():
        most.update({s: 0 for s in (0, 1)})
        for shard, n in _shard_workers(out).items():
            most[shard] = max(most[shard], n)
        with client() as c:
            return c.read_flow_run(flow_run.id).state.is_crashed()

    wait_for(crashed, ZOMBIE_AFTER.total_seconds() + 60, "the heartbeat automation to mark the run Crashed", served)
    crashed_after = time.monotonic() - killed_at
    rerun = wait_for(lambda: [r for r in runs_of("phoenix") if r.id != flow_run.id], 60, "the crash re-run", served)
    assert _shard_workers(out) == Counter({0: 1, 1: 1}), \
        f"the extractions went on while nobody watched: {_shards_told(served.root / 'w-phoenix', served)}"
    wait_for(lambda: len([e for e in events("extract.shard.running", "phoenix") if e.payload.get("adopted")]) == 2,
             60, "the re-run to adopt both shards", served)
    hold.unlink()
    rerun = wait_final(rerun[0].id, timeout=300, served=served)
    assert rerun.state.is_completed(), (rerun.state, served.worker_log())
    assert rerun.parameters["rerun_depth"] == 1 and rerun.parameters["token_budget"] == 256
    adopted = [e for e in events("extract.shard.running", "phoenix") if e.payload.get("adopted")]
    assert {e.payload["shard"]: e.payload["pid"] for e in adopted} == pids, "the same processes, adopted"
    assert max(most.values()) == 1, f"never two writers for one shard: {most}"
    ids = Counter(s["id"] for s in hsextract.read_samples(out, verify=True))
    assert ids == Counter(dataset_ids(served.data))
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:  # the dead run's launch/supervise tasks were closed by the run that adopted their shards
        left = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    assert left and not [t.name for t in left if t.state.is_running() or t.state.is_pending()], \
        [(t.name, t.state.type) for t in left]
    assert any(t.state.is_crashed() and "continues run phoenix" in (t.state.message or "") for t in left)
    print(f"\norchestrator killed -> run marked Crashed: {crashed_after:.1f}s")


def test_cancel_through_the_process_worker_stops_the_workers_ends_cancelled_and_holds_reruns(served):
    """`prefect flow-run cancel` of a deployment run executed by `prefect worker start`: every worker stopped
    (finishing its file, exit record `cancelled`), the run Cancelled, no automation starts anything, the
    scheduled re-run deployment is held, and a run started by a person resumes it exactly once."""
    from prefect.deployments import run_deployment

    out = served.root / "out-cancel"
    data = tiny.build_dataset(served.root / "cancel.jsonl", 320, seed=13)
    slow = faulty.python_for(served.root / "python-slow", {faulty.FORWARD_DELAY_S: "0.25"})  # mid-run when cancelled
    run = dict(output=f"file://{out}", hosts=served.inventory("cancel", python=slow), data=str(data), token_budget=256,
               cancel_grace_s=30)
    flow_run = start("cancel-w", **run)
    workdir = served.root / "w-cancel" / "runs" / "cancel-w"

    def extracting():
        beats = [json.loads(p.read_text()) for p in workdir.glob("shard-*/heartbeat.json")]
        return len(beats) == 2 and all(b.get("samples_done", 0) > 0 for b in beats)

    wait_for(extracting, 120, "both shards extracting", served)
    pids = [int(p.read_text()) for p in workdir.glob("shard-*/pid")]
    asked = time.monotonic()
    proc = served.cli("flow-run", "cancel", str(flow_run.id))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = wait_final(flow_run.id, timeout=90, served=served)
    to_cancelled = time.monotonic() - asked
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().rsplit(
        ") ", 1)[1][0] != "Z" for pid in pids), 40, "no worker left", served)
    to_idle = time.monotonic() - asked
    assert final.state.is_cancelled(), (final.state, served.worker_log())
    for exit_file in workdir.glob("shard-*/exit.json"):
        assert json.loads(exit_file.read_text()).get("stop") == "cancelled", exit_file.read_text()
    assert (out / "_runs" / "cancel-w" / "cancelled.json").exists()
    time.sleep(15)  # what automations would start comes within seconds (their re-run delay is 0 here)
    assert [r.id for r in runs_of("cancel-w")] == [flow_run.id], "nothing re-ran the cancelled run"
    held = run_deployment("extract/qwen-rerun", parameters={"run_name": "cancel-w", **run}, timeout=0)
    held = wait_final(held.id, served=served)
    assert held.state.is_cancelled() and "held" in held.state.message, held.state
    again = wait_final(start("cancel-w", **run).id, timeout=300, served=served)
    assert again.state.is_completed(), (again.state, served.worker_log())
    assert Counter(s["id"] for s in hsextract.read_samples(out, verify=True)) == Counter(dataset_ids(data))
    print(f"\ncancel via process worker: Cancelled after {to_cancelled:.1f}s, no worker after {to_idle:.1f}s")
