"""tasks/launch.sh, the launch shipped in the code bundle, run as a host runs it: /bin/sh, a control dir, a fake
worker that records what it was given. (Over a real sshd, with the real worker: tests/integration/test_launch.py.)"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.worker import proc_stat

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tasks" / "launch.sh"

RECORDER = """#!{python}
import json, os, sys
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
with open("seen.json", "w") as handle:  # in the control dir: the launch runs it there
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "fds": fds, "sid": os.getsid(0),
               "pid": os.getpid(), "stdin": os.readlink("/proc/self/fd/0")}}, handle)
if os.environ.get("BEHAVE") == "live":
    print("STARTED shard=0/1", flush=True)
    open("heartbeat.json", "w").write('{{"time": 1}}')
    import time
    time.sleep(30)
"""


def launch(control: Path, *args: str, ticks: int = 20, gpu: int = 0, env: dict | None = None, timeout: float = 30):
    return subprocess.run(["/bin/sh", str(SCRIPT), str(control), str(ticks), str(gpu), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


@pytest.fixture
def recorder(tmp_path) -> str:
    path = tmp_path / "worker"
    path.write_text(RECORDER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def seen(control: Path) -> dict:
    for _ in range(100):
        try:
            return json.loads((control / "seen.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"the worker never ran; log: {(control / 'worker.log').read_text()}")


def test_starts_the_worker_detached_with_its_argv_byte_identical(tmp_path, recorder):
    control = tmp_path / "control"
    odd = ["--model", "we ird;$(touch x)`y`'\"\n*", "--out", "ü ", ""]
    out = launch(control, "--", recorder, *odd, gpu=3, env={"PYTHONPATH": "/site/extra"})
    assert out.returncode == 0 and out.stdout.startswith("LAUNCHED "), out
    _, pid, start = out.stdout.split()[:3]
    got = seen(control)
    assert got["argv"] == odd and got["pid"] == int(pid) == int((control / "pid").read_text())
    assert (control / "pid.start").read_text().strip() == start != ""
    assert got["env"]["CUDA_VISIBLE_DEVICES"] == "3" and got["env"]["PYTHONUNBUFFERED"] == "1"
    assert got["env"]["PYTHONPATH"] == f"{ROOT}/src:/site/extra", "the bundle's src first, the host's kept"
    assert got["sid"] == got["pid"], "its own session (setsid): the SSH session may end"
    assert got["stdin"] == "/dev/null" and 9 not in got["fds"], "stdin closed, the launch lock not inherited"
    assert not (tmp_path / "x").exists()


def test_environment_is_exported_and_unset_names_removed(tmp_path, recorder):
    control = tmp_path / "control"
    odd = f"x;touch {tmp_path / 'pwned'} $(touch {tmp_path / 'pwned'})"
    out = launch(control, f"AWS_DEFAULT_REGION={odd}", "-AWS_ACCESS_KEY_ID", "--", recorder,
                 env={"AWS_ACCESS_KEY_ID": "inherited"})
    assert out.returncode == 0, out
    env = seen(control)["env"]
    assert env["AWS_DEFAULT_REGION"] == odd and "AWS_ACCESS_KEY_ID" not in env
    assert not (tmp_path / "pwned").exists()


def test_waits_for_started_and_the_first_heartbeat_then_a_second_launch_adopts(tmp_path, recorder):
    control = tmp_path / "control"
    began = time.monotonic()
    first = launch(control, "--", recorder, env={"BEHAVE": "live"}, ticks=100)
    try:
        assert first.stdout.startswith("LAUNCHED ") and time.monotonic() - began < 8, first
        assert (control / "heartbeat.json").is_file() and "STARTED" in (control / "worker.log").read_text()
        pid = first.stdout.split()[1]
        second = launch(control, "--", recorder, env={"BEHAVE": "live"})
        assert second.returncode == 0 and second.stdout.split()[:2] == ["ADOPT", pid], second
    finally:
        subprocess.run(["kill", "-9", (control / "pid").read_text().strip()])


def test_a_live_worker_launched_with_other_arguments_is_not_adopted(tmp_path, recorder):
    """Seen in a test: a run of the same run name with another model adopted the worker of the earlier run
    (still finishing, its exit status written) and took that worker's verdict for its own."""
    control = tmp_path / "control"
    first = launch(control, "--", recorder, "--model", "/a", env={"BEHAVE": "live"}, ticks=100)
    pid = first.stdout.split()[1]
    try:
        assert launch(control, "--", recorder, "--model", "/a", env={"BEHAVE": "live"}).stdout.startswith("ADOPT")
        began = time.monotonic()
        other = launch(control, "--", recorder, "--model", "/b", env={"BEHAVE": "live"})
        assert other.returncode == 75 and other.stdout.startswith(f"BUSY {pid}: ") and "run_name" in other.stdout
        assert time.monotonic() - began < 5, "no exit status: it is not finishing, so no wait"
        (control / "exit.json").write_text('{"code": 2}')  # finishing: the next launch waits for its end
        (control / "seen.json").unlink()
        threading.Timer(1.0, lambda: subprocess.run(["kill", "-9", pid])).start()
        after = launch(control, "--", recorder, "--model", "/b", env={"BEHAVE": "live"}, ticks=100)
        assert after.stdout.startswith("LAUNCHED ") and seen(control)["argv"][-1] == "/b", after
        assert not (control / "exit.json").exists(), "the old worker's verdict is gone"
    finally:
        subprocess.run(["kill", "-9", (control / "pid").read_text().strip()])


def test_a_zombie_with_the_recorded_pid_is_not_adopted(tmp_path, recorder):
    """Seen in CI: the worker of an earlier run exited, was never reaped (PID 1 of a container may not reap),
    and `kill -0` still succeeded on its pid: the re-run adopted a dead shard."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        time.sleep(0.2)
        control = tmp_path / "control"
        control.mkdir()
        start = proc_stat(pid)[19]
        (control / "pid").write_text(f"{pid}\n")
        (control / "pid.start").write_text(start)
        out = launch(control, "--", recorder, ticks=2)
        assert out.stdout.startswith("LAUNCHED ") and f"ADOPT {pid}" not in out.stdout, out
    finally:
        os.waitpid(pid, 0)


def test_a_held_lock_and_an_unwritable_log_are_said(tmp_path, recorder):
    control = tmp_path / "control"
    control.mkdir()
    with open(control / ".launch.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
        (tmp_path / "bin").mkdir()  # a flock that gives up at once, so the test does not wait 30 s
        (tmp_path / "bin" / "flock").write_text("#!/bin/sh\nexec /usr/bin/flock -w 0.2 \"$3\"\n")
        (tmp_path / "bin" / "flock").chmod(0o755)
        busy = launch(control, "--", recorder, env=env)
    assert busy.returncode == 75 and busy.stdout.strip() == "LOCK BUSY", busy
    (control / "worker.log").mkdir()
    unwritable = launch(control, "--", recorder)
    assert unwritable.returncode == 73 and unwritable.stdout.strip() == "LOG UNWRITABLE", unwritable
    assert not (control / "seen.json").exists(), "nothing was started"


def test_a_worker_that_dies_at_once_ends_the_wait(tmp_path):
    control = tmp_path / "control"
    began = time.monotonic()
    out = launch(control, "--", "/bin/false", ticks=100)
    assert out.stdout.startswith("LAUNCHED ") and time.monotonic() - began < 5, out
