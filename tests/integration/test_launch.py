"""Launch proofs and supervision against real sshd hosts: every way a launch goes wrong ends Failed, fast."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.inventory import ssh_host_entry, write_inventory
from hsextract import tiny
from hsextract.errors import Retry
from hsextract.options import WorkerOptions
from tasks.bundle import build_bundle
from tasks.deploy import DeployFailed, deploy_host
from tasks.hosts import HostError, SshHost, connect
from tasks.inventory import parse_inventory
from tasks.shards import Deadlines, ShardFailed, ShardJob, launch_shard, probe, supervise_shard

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 1.0
FAST = Deadlines(launch_timeout_s=20, poll_interval_s=0.2, stall_timeout_s=1.5 * HEARTBEAT_S, host_timeout_s=4,
              command_timeout_s=5)


@pytest.fixture(scope="module")
def env(farm, tmp_path_factory, tiny_model):
    """Inventory over the farm, the bundle deployed on every host, a dataset big enough to run ~15 s."""
    base = tmp_path_factory.mktemp("launch")
    data = tiny.build_dataset(base / "data.jsonl", 1500, seed=4)
    entries = [ssh_host_entry(farm.host(n), base / f"work-{n}") for n in ("h1", "h2", "lo")]
    inventory = parse_inventory(write_inventory(base / "hosts.yaml", entries).read_text())
    bundle = build_bundle(ROOT)
    for spec in inventory.hosts:
        with connect(spec, inventory) as host:
            deploy_host(host, bundle, "0.1.0")
    return dict(base=base, data=data, inventory=inventory, digest=bundle.sha256, model=tiny_model, bundle=bundle)


def job_for(env, host: str, shard: int = 0, python: str = sys.executable, run: str = "t", budget: int = 128,
            num_shards: int = 1, data: Path | None = None) -> ShardJob:
    options = WorkerOptions(model=env["model"], data=data or env["data"], out=f"{env['base']}/out-{run}", layers="1,3",
                            token_budget=budget, progress="log", heartbeat_interval=HEARTBEAT_S, device="cpu")
    return ShardJob.on(run, env["inventory"].host(host), 0, env["digest"], options, shard, num_shards, python=python)


def open_host(env, name):
    return connect(env["inventory"].host(name), env["inventory"])


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_happy_launch_then_supervise_to_done(env):
    job = job_for(env, "h1", run="happy", budget=4096)
    with open_host(env, "h1") as host:
        launched = launch_shard(host, job, FAST)
        assert launched.started_line.startswith("STARTED shard=0/1") and launched.first_heartbeat
        assert not launched.adopted and launched.seconds < 10
        summary = supervise_shard(host, job, launched, FAST)
    assert summary["samples_done"] == 1500


@pytest.mark.parametrize("case", ["exit0_silent", "interpreter_missing", "dies_at_import", "log_unwritable"])
def test_failed_launch_is_fast_and_says_why(env, case, tmp_path):
    python = {"exit0_silent": "/bin/true", "interpreter_missing": "/nonexistent/bin/python3",
              "dies_at_import": script(tmp_path / "py", f"mkdir -p {tmp_path}/broken/hsextract\n"
                                       f"echo 'raise ImportError(\"broken on purpose\")' > "
                                       f"{tmp_path}/broken/hsextract/__init__.py\n"
                                       f"PYTHONPATH={tmp_path}/broken exec {sys.executable} \"$@\""),
              "log_unwritable": sys.executable}[case]
    job = job_for(env, "h2", python=python, run=f"bad-{case}")
    if case == "log_unwritable":
        Path(job.control_dir, "worker.log").mkdir(parents=True)
    started = time.monotonic()
    with open_host(env, "h2") as host, pytest.raises(ShardFailed) as failed:
        launch_shard(host, job, FAST)
    elapsed = time.monotonic() - started
    message = str(failed.value)
    assert elapsed < 10, f"took {elapsed:.1f}s"
    assert "shard 0/1 on h2" in message
    expect = {"exit0_silent": "exited at once, printing no STARTED line",
              "interpreter_missing": "/nonexistent/bin/python3",
              "dies_at_import": "broken on purpose",
              "log_unwritable": "cannot create the worker log"}[case]
    assert expect in message, message


def run_then(env, host_name, action, policy=FAST, run="x"):
    """Launch a long shard, wait until it is extracting, apply `action(host, launched)`, supervise."""
    job = job_for(env, host_name, run=run)
    with open_host(env, host_name) as host:
        launched = launch_shard(host, job, policy)
        deadline = time.monotonic() + 60
        while probe(host, job, 5).heartbeat.get("phase") != "extracting":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        action(host, launched)
        acted = time.monotonic()
        with pytest.raises(ShardFailed) as failed:
            supervise_shard(host, job, launched, policy)
        return str(failed.value), time.monotonic() - acted, job, launched


def test_kill9_is_lost_within_two_heartbeats(env):
    message, detected, _, _ = run_then(env, "lo", lambda h, l: h.run(f"kill -9 {l.pid}", 5), run="kill9")
    assert "lost" in message and "left no exit status" in message
    assert detected < 2 * HEARTBEAT_S, f"{detected:.2f}s"


def test_sigstop_is_stalled_within_two_heartbeats_and_killed(env):
    message, detected, job, launched = run_then(env, "lo", lambda h, l: h.run(f"kill -STOP {l.pid}", 5),
                                                run="stop")
    assert "stalled" in message and "state T" in message
    assert detected < 2 * HEARTBEAT_S + FAST.poll_interval_s, f"{detected:.2f}s"
    time.sleep(0.5)
    assert not Path(f"/proc/{launched.pid}").exists() or "Z" in Path(f"/proc/{launched.pid}/stat").read_text()


def test_host_cut_off_mid_run_fails_within_deadline(env, farm):
    if farm.host("h1").netns is None:
        pytest.skip("network namespaces unavailable: cannot cut one host's link")
    try:
        message, detected, job, launched = run_then(env, "h1", lambda h, l: farm.cut("h1"), run="cut")
    finally:
        farm.restore("h1")
    assert "host unreachable" in message
    limit = FAST.host_timeout_s + FAST.command_timeout_s + 10
    assert detected < limit, f"{detected:.1f}s"
    with open_host(env, "h1") as host:  # the worker itself lived on; stop it
        host.run(f"kill -9 {launched.pid}", 5)


def test_a_launch_in_a_pool_is_proven_by_its_hosts_shared_round_trips(env, tmp_path):
    """A worker slower to prove itself than the launch command waits: the proof comes from the host monitor's
    round trips (every LAUNCH_POLL_S while a launch waits, whatever the poll interval), not probes of its own;
    a worker that dies meanwhile still fails with its log's tail (fetched for that shard alone)."""
    from tasks.monitor import LAUNCH_POLL_S, HostPool

    # slower than the launch command's own wait (50 ticks of 0.1 s, which a loaded machine stretches): proven by
    # the pool's round trips, not by the launch command's probe
    slow = script(tmp_path / "slow", f"sleep 9; exec {sys.executable} \"$@\"")
    dies = script(tmp_path / "dies", "sleep 6; echo 'CUDA error: no device on purpose' >&2; exit 3")
    with HostPool(env["inventory"], 30.0, 5) as pool:
        job = job_for(env, "h1", python=slow, run="pooled", budget=4096)
        watch = pool.watch(job, launching=True)
        try:
            launched = launch_shard(pool.host("h1"), job, FAST, watch)
        finally:
            watch.close()
        assert launched.started_line.startswith("STARTED shard=0/1") and launched.seconds > 5
        trips = pool.stats()["round_trips"]
        assert 1 <= trips <= (launched.seconds - 5) / LAUNCH_POLL_S + 3, trips  # paced for the launch, not 30 s
        assert pool.stats()["connections"] == 1
        summary = supervise_shard(pool.host("h1"), job, launched, FAST)
        assert summary["samples_done"] == 1500

        job = job_for(env, "h1", python=dies, run="pooled-dies")
        watch = pool.watch(job, launching=True)
        try:
            with pytest.raises(ShardFailed) as failed:
                launch_shard(pool.host("h1"), job, FAST, watch)
        finally:
            watch.close()
    message = str(failed.value.evidence)
    assert "exited at once, printing no STARTED line" in message or "exited with code 3" in message, message
    assert "no device on purpose" in message, message


def test_two_launches_of_one_shard_adopt(env):
    job = job_for(env, "h2", run="twice")
    results, errors = [], []

    def go():
        try:
            with open_host(env, "h2") as host:
                results.append(launch_shard(host, job, FAST))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    assert sorted(r.adopted for r in results) == [False, True]
    assert results[0].pid == results[1].pid
    with open_host(env, "h2") as host:
        third = launch_shard(host, job, FAST)
        assert third.adopted and third.pid == results[0].pid
        host.run(f"kill -9 {third.pid}", 5)


def test_unknown_host_key_refused_unless_opted_in(env, farm, tmp_path):
    entry = ssh_host_entry(farm.host("h2"), tmp_path / "w", known_hosts=str(farm.known_hosts_without("h2")))
    inventory = parse_inventory(write_inventory(tmp_path / "i.yaml", [entry]).read_text())
    with SshHost(inventory.hosts[0], inventory) as host, pytest.raises(HostError) as err:
        host.run("true", 5)
    assert "not found in known_hosts" in str(err.value) and err.value.retry is not Retry.NOW
    assert "cannot connect to" in str(err.value) and "was never sent" in str(err.value)
    entry["known_hosts"] = str(farm.known_hosts_with_wrong_key("h2"))
    inventory = parse_inventory(write_inventory(tmp_path / "i.yaml", [entry]).read_text())
    with SshHost(inventory.hosts[0], inventory) as host, pytest.raises(HostError) as err:
        host.run("true", 5)
    assert "BadHostKey" in str(err.value) or "does not match" in str(err.value)
    entry.update(known_hosts=str(farm.known_hosts_without("h2")), accept_unknown_host_keys=True)
    inventory = parse_inventory(write_inventory(tmp_path / "i.yaml", [entry]).read_text())
    with SshHost(inventory.hosts[0], inventory) as host:
        assert host.run("echo hi", 5).stdout == "hi\n"


def test_command_past_its_timeout_is_a_timeout_and_the_host_still_answers(env):
    # invoke's timer may let the run return "no exit status" (-1) instead of CommandTimedOut: either way the
    # caller is told the command was still running, never that it exited.
    with open_host(env, "h1") as host:
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(HostError) as err:
                host.run("sleep 30", 1)
            assert "still running after 1s" in str(err.value) and "sleep 30" in str(err.value), err.value
            assert err.value.retry is Retry.NOW and time.monotonic() - started < 10
        assert host.run("echo back", 5).stdout == "back\n"


def test_deploy_failures_name_host_and_cause(env, farm, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = {"put fails": dict(workdir=str(blocker / "w")),
             "prints nothing": dict(python="/bin/true"),
             "interpreter missing": dict(python="/nonexistent/python3")}
    for case, change in cases.items():
        entry = ssh_host_entry(farm.host("lo"), tmp_path / "w", **{k: v for k, v in change.items() if k != "workdir"})
        entry.update({k: v for k, v in change.items() if k == "workdir"})
        inventory = parse_inventory(write_inventory(tmp_path / "i.yaml", [entry]).read_text())
        with connect(inventory.hosts[0], inventory) as host, pytest.raises(DeployFailed) as failed:
            deploy_host(host, env["bundle"], "0.1.0", timeout=30)
        message = failed.value.evidence
        assert str(failed.value).startswith("host lo: "), (case, str(failed.value))
        if case == "put fails":
            assert "uploading the bundle" in message
        elif case == "prints nothing":
            assert "did not prove the bundle" in message and "BUNDLE" in message
        else:
            assert "/nonexistent/python3" in message and re.search(r"not found|No such file", message)


def test_unchanged_bundle_is_skipped_changed_one_pushed(env, tmp_path):
    import shutil

    with open_host(env, "h2") as host:
        again = deploy_host(host, env["bundle"], "0.1.0")
        assert again.skipped and again.seconds < 3 and '"torch"' in again.environment
        shutil.copytree(ROOT / "src", tmp_path / "src")
        (tmp_path / "CHANGED").write_text("one more file")
        changed = build_bundle(tmp_path)
        assert changed.sha256 != env["bundle"].sha256
        pushed = deploy_host(host, changed, "0.1.0")
        assert not pushed.skipped and pushed.bundle_sha256 == changed.sha256
        listing = host.run(f"cat {host.spec.workdir}/bundles/{changed.sha256}/CHANGED", 5)
        assert listing.stdout == "one more file"


def test_overlapping_deploys_of_one_bundle_to_one_workdir_all_succeed(env, farm, tmp_path):
    """Two runs (or two inventory entries for one machine) deploying at once: each unpacks on its own, the
    bundle ends whole, and no stray tarball or temp dir stays behind."""
    import threading

    entry = ssh_host_entry(farm.host("lo"), tmp_path / "shared-w")
    inventory = parse_inventory(write_inventory(tmp_path / "i.yaml", [entry]).read_text())
    results, errors = [], []

    def deploy_once():
        try:
            with connect(inventory.hosts[0], inventory) as host:
                results.append(deploy_host(host, env["bundle"], "0.1.0"))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=deploy_once) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(results) == 3, errors
    bundles = tmp_path / "shared-w" / "bundles"
    assert sorted(p.name for p in bundles.iterdir()) == [env["bundle"].sha256]
    assert (bundles / env["bundle"].sha256 / ".complete").read_text() == env["bundle"].sha256
    assert (bundles / env["bundle"].sha256 / "src" / "hsextract" / "cli.py").is_file()


def wait_extracting(host, job) -> None:
    deadline = time.monotonic() + 60
    while (probe(host, job, 5).heartbeat or {}).get("phase") != "extracting":
        assert time.monotonic() < deadline, "never reached extracting"
        time.sleep(0.2)


def test_stop_workers_stops_the_runs_workers_on_every_host_and_a_relaunch_resumes(env, tmp_path):
    """Two shards of one run on two hosts, extracting: one `stop_workers` SIGTERMs both (each finishes the file
    in flight, journals it, and names the stop request in its exit record); supervise ends ShardStopped, not a
    failure; a launch afterwards resumes each shard to every sample exactly once. The workers run on a slow GPU
    (every forward pass 0.1 s longer): the stop lands mid-shard however long it takes to arrive."""
    from harness.faulty import FORWARD_DELAY_S, python_for
    from harness.worker import dataset_ids
    from hsextract import read_samples
    from tasks.cancel import stop_workers
    from tasks.shards import ShardStopped

    data = tiny.build_dataset(tmp_path / "data.jsonl", 240, seed=9)
    slow = python_for(tmp_path / "python-slow", {FORWARD_DELAY_S: "0.1"})
    jobs = [job_for(env, name, shard=n, run="cancel", num_shards=2, budget=256, data=data, python=slow)
            for n, name in enumerate(("h1", "h2"))]
    launched = []
    for job in jobs:
        with open_host(env, job.host) as host:
            launched.append(launch_shard(host, job, FAST))
    for job in jobs:
        with open_host(env, job.host) as host:
            wait_extracting(host, job)
    stops = {s.host: s for s in stop_workers(env["inventory"], "cancel", "cancelled", "a test cancels", 30)}
    assert {h: list(s.signalled) for h, s in stops.items()} == {
        "h1": ["shard-00000-of-00002"], "h2": ["shard-00001-of-00002"], "lo": []}, stops
    assert not any(s.alive or s.error for s in stops.values()), [s.describe() for s in stops.values()]
    for job, proof in zip(jobs, launched):
        with open_host(env, job.host) as host, pytest.raises(ShardStopped) as stopped:
            supervise_shard(host, job, proof, FAST)
        assert stopped.value.kind == "cancelled" and "a test cancels" in stopped.value.why, stopped.value
        assert "code 143" in stopped.value.why
    for job in jobs:
        with open_host(env, job.host) as host:
            again = launch_shard(host, job, FAST)
            assert not again.adopted
            supervise_shard(host, job, again, FAST)
    ids = [s["id"] for s in read_samples(jobs[0].options.out)]
    assert sorted(ids) == sorted(dataset_ids(data)), "every sample exactly once after the stop"


def test_a_worker_that_ignores_sigterm_is_killed_on_its_host_after_the_grace(env, tmp_path):
    """The orchestrator sends the stop and is gone: the host's own sleeper SIGKILLs the worker (its whole process
    group) once the grace is over, and says so in the shard's stop.log."""
    from tasks.cancel import stop_workers

    stubborn = script(tmp_path / "stubborn", "trap '' TERM\necho \"STARTED shard=0/1 pid=$$ version=stub\"\n"
                                             "echo '{\"phase\": \"extracting\"}' > heartbeat.json\nsleep 600 &\nwait")
    job = job_for(env, "lo", run="cancel-stubborn", python=stubborn)
    with open_host(env, "lo") as host:
        proof = launch_shard(host, job, FAST)
        began = time.monotonic()
        (stop,) = [s for s in stop_workers(env["inventory"], "cancel-stubborn", "cancelled", "stubborn", 2.0,
                                           wait_s=0) if s.host == "lo"]
        assert stop.signalled == {"shard-00000-of-00001": proof.pid}
        time.sleep(1.0)
        assert probe(host, job, 5).alive, "SIGTERM is ignored: it still runs within the grace"
        while probe(host, job, 5).alive:
            assert time.monotonic() - began < 10, "not killed 10 s after a 2 s grace"
            time.sleep(0.2)
        # what is left of the process group: nothing, or zombies (where this machine's init does not reap them)
        killed = host.run(f"cat {job.control_dir}/stop.log; for p in $(pgrep -g {proof.pid}); do "
                          f"sed 's/.*) //' /proc/$p/stat | cut -d' ' -f1; done", 5).stdout.split()
    assert " ".join(killed[:4]) == f"KILLED {proof.pid} after 2s", killed
    assert set(killed[4:]) <= {"Z"}, f"the worker's process group still runs: {killed}"
