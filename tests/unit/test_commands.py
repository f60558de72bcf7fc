"""Command builders tested as strings, and run through a real /bin/sh where that proves more."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from harness.worker import proc_stat, running
from tasks.commands import alive_cmd, check_bundle_cmd, kill_cmd, launch_cmd, parse_probe, probe_cmd

ROOT = Path(__file__).resolve().parents[2]  # a checkout holds tasks/launch.sh where an unpacked bundle does

def nasty(tmp_path) -> str:
    canary = tmp_path / "pwned"
    return f"we ird;$(touch {canary})`touch {canary}`'\"\n*;touch {canary}"


def test_every_value_is_quoted_and_nothing_else_runs(tmp_path):
    name = nasty(tmp_path)
    control, workdir = str(tmp_path / name / "control"), str(tmp_path / name)
    cmd = launch_cmd(control, str(ROOT), 3, ["/bin/true", "--model", name, "--out", name], name, wait_s=0.2)
    assert cmd.startswith(f"sh {ROOT}/tasks/launch.sh "), "the launch is the bundle's script"
    out = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("LAUNCHED "), out
    assert "\n---HEARTBEAT\n" in out.stdout, "the probe follows in the same round trip"
    for builder in (probe_cmd(control, name), kill_cmd(control), check_bundle_cmd(workdir, name, name)):
        subprocess.run(["/bin/sh", "-c", builder], capture_output=True, cwd=tmp_path)
    assert (tmp_path / name / "control" / "pid").is_file(), "the literal odd path was used"
    assert not (tmp_path / "pwned").exists(), "an interpolated value ran as a command"
    with pytest.raises(ValueError, match="not allowed"):
        launch_cmd(control, str(ROOT), 0, ["p"], "/j", env={"A;rm -rf /": "x"})


def test_probe_of_missing_control_dir_runs_and_parses(tmp_path):
    out = subprocess.run(["/bin/sh", "-c", probe_cmd(str(tmp_path / "nope"), "/nope")], capture_output=True,
                         text=True)
    assert out.returncode == 0 and not parse_probe(out.stdout).has_control_dir


def test_probe_parses_a_live_process(tmp_path):
    control = tmp_path / "control dir"
    control.mkdir()
    proc = subprocess.Popen(["sleep", "30"])
    try:
        start = proc_stat(proc.pid)[19]
        (control / "pid").write_text(f"{proc.pid}\n")
        (control / "pid.start").write_text(start + "\n")
        (control / "heartbeat.json").write_text('{"time": 1.5, "phase": "extracting"}')
        (control / "worker.log").write_text("STARTED shard=0/1 pid=1 version=x\nline two\n")
        out = subprocess.run(["/bin/sh", "-c", probe_cmd(str(control), str(tmp_path / "j"))], capture_output=True,
                             text=True).stdout
        probe = parse_probe(out)
        assert probe.alive and probe.pid == proc.pid and probe.state in ("S", "R")
        assert probe.heartbeat["phase"] == "extracting" and probe.heartbeat_age > 0
        assert probe.started_line.startswith("STARTED shard=0/1") and "line two" in probe.log
        assert probe.exit is None and probe.journal_last is None
        # a reused pid (other start time) is not our process
        (control / "pid.start").write_text("1\n")
        assert not parse_probe(subprocess.run(["/bin/sh", "-c", probe_cmd(str(control), "/j")], capture_output=True,
                                              text=True).stdout).alive
        # kill_cmd refuses a pid whose start time does not match, then kills the right one
        subprocess.run(["/bin/sh", "-c", kill_cmd(str(control))], capture_output=True)
        assert proc.poll() is None
        (control / "pid.start").write_text(start + "\n")
        subprocess.run(["/bin/sh", "-c", kill_cmd(str(control))], capture_output=True)
        assert proc.wait(timeout=5) == -9
    finally:
        proc.kill()


def test_probe_sees_zombie_as_not_alive(tmp_path):
    import os

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        time.sleep(0.2)  # child exits; we do not reap it yet: a zombie
        control = tmp_path
        start = proc_stat(pid)[19]
        (control / "pid").write_text(f"{pid}\n")
        (control / "pid.start").write_text(start)
        probe = parse_probe(subprocess.run(["/bin/sh", "-c", probe_cmd(str(control), "/j")], capture_output=True,
                                           text=True).stdout)
        assert probe.state == "Z" and not probe.alive
    finally:
        os.waitpid(pid, 0)


def test_the_stop_s_watch_sees_a_live_worker_and_not_one_that_ended_unreaped(tmp_path):
    """A worker that ended but whose parent has not reaped it (a zombie) has ended: the stop's watch must not wait
    the whole grace for it."""
    import os

    live = subprocess.Popen(["sleep", "30"])
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # the child exits; unreaped, it stays a zombie
        for name, p in (("shard-00000-of-00002", live.pid), ("shard-00001-of-00002", pid)):
            d = tmp_path / "runs" / "r" / name
            d.mkdir(parents=True)
            (d / "pid").write_text(f"{p}\n")
            (d / "pid.start").write_text(proc_stat(p)[19] + "\n")
        assert proc_stat(pid)[0] == "Z"
        said = subprocess.run(["/bin/sh", "-c", alive_cmd(str(tmp_path), "r", ["shard-00000-of-00002",
                                                                                "shard-00001-of-00002"])],
                              capture_output=True, text=True).stdout.splitlines()
        assert said == [f"ALIVE shard-00000-of-00002 {live.pid}", "CHECKED"], said
    finally:
        live.kill()
        live.wait()
        os.waitpid(pid, 0)


@pytest.mark.parametrize("run", ["../../etc", "a/b", ".", "..", "-rf", "x y", "x;y", "", "é", "a" * 201])
def test_a_run_name_is_one_plain_directory_name(run):
    from tasks.commands import control_dir

    with pytest.raises(ValueError, match="run name"):
        control_dir("/w", run, "shard-00000-of-00001")
    assert control_dir("/w", "run-1.b_c", "shard-00000-of-00001") == "/w/runs/run-1.b_c/shard-00000-of-00001"


def test_every_host_command_runs_under_umask_027_and_the_bundle_unpacks_with_it(tmp_path):
    from tasks.commands import unpack_bundle_cmd
    from tasks.hosts import wrap

    out = subprocess.run(["/bin/sh", "-c", wrap(f"mkdir -p {tmp_path}/a/b && touch {tmp_path}/a/b/f")])
    assert out.returncode == 0
    assert [oct((tmp_path / p).stat().st_mode & 0o777) for p in ("a", "a/b", "a/b/f")] == ["0o750", "0o750", "0o640"]
    assert "--no-same-permissions" in unpack_bundle_cmd("/w", "0" * 64, "n1"), "root's tar would keep the archive's 0644"


def test_one_round_trip_reads_every_shard_of_a_host(tmp_path):
    """supervision at fleet scale: one command per host and interval, each shard's probe the same as its own."""
    from tasks.commands import parse_probe_many, probe_many_cmd

    proc = subprocess.Popen(["sleep", "30"])
    try:
        start = proc_stat(proc.pid)[19]
        shards = []
        for n in range(3):
            control = tmp_path / f"shard {n}"
            control.mkdir()
            (control / "pid").write_text(f"{proc.pid}\n")
            (control / "pid.start").write_text(start if n != 1 else "1")  # shard 1: a reused pid
            # what a worker writes cannot pass for a delimiter: the nonce is fresh per call
            (control / "heartbeat.json").write_text(json.dumps({"time": 2.0, "phase": f"p{n}",
                                                                "last_batch": "===abc 9"}))
            (tmp_path / f"j{n}").write_text('{"kind": "done", "summary": {}}\n' if n == 2 else '{"kind": "file"}\n')
            (control / "worker.log").write_text(f"loading\nSTARTED shard={n}/3 pid={proc.pid}\n")
            if n == 2:  # finished: its exit record, so its journal's last line is read
                (control / "exit.json").write_text('{"code":0,"reason":"done"}')
            shards.append((str(n), str(control), str(tmp_path / f"j{n}"), n == 0))  # shard 0: a launch waits
        shards.append(("7", str(tmp_path / "missing"), "/nope"))
        cmd = probe_many_cmd(shards, "abc")
        out = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True).stdout
        probes = parse_probe_many(out, "abc")
        assert sorted(probes) == ["0", "1", "2", "7"]
        assert probes["0"].alive and not probes["1"].alive and probes["2"].alive
        assert [probes[k].heartbeat["phase"] for k in "012"] == ["p0", "p1", "p2"]
        assert probes["2"].journal_last["kind"] == "done" and probes["0"].journal_last is None
        assert probes["2"].exit == {"code": 0, "reason": "done"} and probes["0"].exit is None
        # the STARTED line for the launch that waits for it only
        assert probes["0"].started_line == f"STARTED shard=0/3 pid={proc.pid}" and probes["1"].started_line == ""
        assert probes["0"].now is not None and probes["0"].now == probes["2"].now  # one clock reading
        assert not probes["7"].has_control_dir
        single = parse_probe(subprocess.run(["/bin/sh", "-c", probe_cmd(shards[0][1], shards[0][2])],
                                            capture_output=True, text=True).stdout)
        assert (single.pid, single.state, single.proc_start, single.recorded_start, single.heartbeat,
                single.started_line) == (probes["0"].pid, probes["0"].state, probes["0"].proc_start,
                                         probes["0"].recorded_start, probes["0"].heartbeat, probes["0"].started_line)
        assert probes["0"].log == "" and "STARTED" in single.log  # no log tails in the host's round trip
        assert parse_probe_many(out.rsplit("===abc END", 1)[0], "abc") == {}  # cut off: nothing
    finally:
        proc.kill()
