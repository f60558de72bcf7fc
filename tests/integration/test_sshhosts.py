"""The sshd farm test harness (tests/harness/sshd.py) against the real OpenSSH client."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import harness.sshd as sshhosts
from harness.sshd import SshdFarm, FarmHost

pytestmark = pytest.mark.timeout(120)

NEEDS_NETNS = pytest.mark.skipif(not sshhosts.netns_supported(),
                                 reason="network namespaces unavailable (need root and a working `ip netns`/veth)")


def ssh(host: FarmHost, *remote: str, timeout: float = 20, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(host.ssh_argv(*remote, **kw), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def ns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> set[str]:
    return set(os.listdir("/sys/class/net"))


@pytest.fixture(scope="module")
def farm():
    with SshdFarm() as f:
        yield f


@pytest.fixture(scope="module")
def lo_host(farm) -> FarmHost:
    return farm.add_host("lo1")


@pytest.fixture(scope="module")
def lo2(farm) -> FarmHost:
    return farm.add_host("lo2")


@pytest.fixture
def any_ns_host(farm, request) -> FarmHost | None:
    """A netns host when available, else None (for tests that also hold without namespaces)."""
    return request.getfixturevalue("ns_hosts")[1] if farm.netns_available else None


@pytest.fixture(scope="module")
def ns_hosts(farm) -> tuple[FarmHost, FarmHost]:
    if not farm.netns_available:
        pytest.skip("network namespaces unavailable (need root and a working `ip netns`/veth)")
    return farm.add_host("ns1", netns=True), farm.add_host("ns2", netns=True)


def test_loopback_host_runs_a_command(lo_host):
    assert lo_host.netns is None and lo_host.hostname == "127.0.0.1" and lo_host.port != 22
    r = ssh(lo_host, "echo", "ok")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    r = ssh(lo_host, "id -un; echo $PATH")
    user, path = r.stdout.split()
    assert user == lo_host.user
    assert ".pyenv" not in path  # ~/.bashrc is not sourced (skip_shell_rc)


def test_known_hosts_format(farm, lo_host, lo2, any_ns_host):
    lines = farm.known_hosts.read_text().splitlines()
    for h in (lo_host, lo2):
        assert f"[127.0.0.1]:{h.port} {h.host_public_key}" in lines
    if any_ns_host:
        assert f"{any_ns_host.hostname} {any_ns_host.host_public_key}" in lines  # port 22: bare address
    assert len(lines) == len(farm.hosts)
    assert all(re.fullmatch(r"\S+ ssh-ed25519 AAAA\S+", l) for l in lines)


@NEEDS_NETNS
def test_netns_hosts_see_their_own_address(ns_hosts):
    a, b = ns_hosts
    assert a.netns and b.netns and a.netns != b.netns
    assert a.port == b.port == 22
    for me, other in ((a, b), (b, a)):
        assert re.fullmatch(r"10\.251\.\d+\.2", me.hostname)
        r = ssh(me, "hostname -I; ip -4 -o addr show")
        assert r.returncode == 0, r.stderr
        assert me.hostname in r.stdout.splitlines()[0].split()  # hostname -I
        assert f"inet {me.hostname}/30" in r.stdout
        assert other.hostname not in r.stdout
        # The root namespace is reachable from inside at the gateway address.
        r = ssh(me, f"ip route get {me.gateway}")
        assert r.returncode == 0 and "dev eth0" in r.stdout, r.stdout + r.stderr


@NEEDS_NETNS
def test_cut_and_restore(farm, ns_hosts):
    a, b = ns_hosts
    # An open session stalls across a short cut and finishes once the link is back.
    session = subprocess.Popen(a.ssh_argv("for i in 1 2 3 4 5 6; do echo $i; sleep 0.3; done"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    time.sleep(0.6)
    farm.cut(a.name)
    try:
        assert farm.is_cut(a.name)
        t = time.monotonic()
        r = ssh(a, "true", connect_timeout=2)
        assert r.returncode == 255
        assert "timed out" in r.stderr, r.stderr  # silently dropped, not refused / not leaked out of the machine
        assert time.monotonic() - t < 8
        assert ssh(b, "true").returncode == 0  # the other host is unaffected
        assert sshhosts._pid_alive(a.sshd_pid)  # the host's processes live on
    finally:
        farm.restore(a.name)
    assert not farm.is_cut(a.name)
    r = ssh(a, "echo", "back", connect_timeout=2)
    assert r.returncode == 0 and r.stdout.strip() == "back", r.stderr
    out, err = session.communicate(timeout=30)
    assert session.returncode == 0, err
    assert out.split() == ["1", "2", "3", "4", "5", "6"]


def test_cut_loopback_host_is_not_supported(farm, lo_host):
    with pytest.raises(NotImplementedError):
        farm.cut(lo_host.name)
    with pytest.raises(NotImplementedError):
        farm.restore(lo_host.name)


def test_unknown_host_key_is_rejected(farm, lo_host, lo2):
    kh = farm.known_hosts_without(lo_host.name)
    assert kh != farm.known_hosts
    r = ssh(lo_host, "true", known_hosts=kh)
    assert r.returncode == 255
    assert "Host key verification failed" in r.stderr or re.search(r"No \S+ host key is known", r.stderr), r.stderr
    # The other hosts are still in that file.
    assert ssh(lo2, "true", known_hosts=kh).returncode == 0


def test_changed_host_key_is_rejected(farm, lo_host, any_ns_host):
    for h in filter(None, (lo_host, any_ns_host)):
        kh = farm.known_hosts_with_wrong_key(h.name)
        assert h.host_public_key not in kh.read_text()
        r = ssh(h, "true", known_hosts=kh)
        assert r.returncode == 255
        assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.stderr, r.stderr
    assert ssh(lo_host, "true").returncode == 0  # the farm's own file is untouched


def test_sftp_subsystem_and_paramiko(lo_host):
    paramiko = pytest.importorskip("paramiko")
    client = paramiko.SSHClient()
    client.load_host_keys(str(lo_host.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(lo_host.hostname, port=lo_host.port, username=lo_host.user,
                   key_filename=str(lo_host.key_filename), look_for_keys=False, allow_agent=False, timeout=5)
    try:
        _, stdout, _ = client.exec_command("echo via-paramiko")
        assert stdout.read().decode().strip() == "via-paramiko"
        with client.open_sftp() as sftp:
            assert sftp.normalize(".")
    finally:
        client.close()


def test_stop_and_start(farm):
    h = farm.add_host("stoppable")
    old = h.sshd_pid
    farm.stop(h.name)
    assert not sshhosts._pid_alive(old)
    r = ssh(h, "true", connect_timeout=2)
    assert r.returncode == 255 and "refused" in r.stderr, r.stderr
    farm.start(h.name)
    assert h.sshd_pid != old
    assert ssh(h, "echo", "again").stdout.strip() == "again"


def test_netns_request_falls_back_to_loopback(monkeypatch):
    monkeypatch.setattr(sshhosts, "netns_supported", lambda: False)
    with SshdFarm() as f:
        assert not f.netns_available
        h = f.add_host("fallback", netns=True)
        assert h.netns is None and h.hostname == "127.0.0.1"
        assert ssh(h, "echo", "ok").stdout.strip() == "ok"


def test_close_removes_everything():
    f = SshdFarm()
    hosts = [f.add_host("a")]
    if f.netns_available:
        hosts += [f.add_host("b", netns=True), f.add_host("c", netns=True)]
    namespaces = f.namespaces()
    assert sorted(namespaces) == sorted(h.netns for h in hosts if h.netns)
    assert set(namespaces) <= set(ns_list())
    before = links()
    farm_links = {l for l in before if re.fullmatch(r"hsx[vst]\d+", l)}
    directory = f.directory
    pids = [h.sshd_pid for h in hosts]
    f.close()
    f.close()  # idempotent
    assert not set(namespaces) & set(ns_list())
    assert all(gone(p) for p in pids)
    assert not directory.exists()
    leftover = links() & farm_links
    # Only links of other concurrently running farms may remain (none of ours: they carry our namespace names).
    for l in leftover:
        alias = Path(f"/sys/class/net/{l}/ifalias").read_text().strip()
        assert alias not in namespaces


def gone(pid: int) -> bool:
    """Exited (a zombie counts: this machine's init may never reap orphans)."""
    return not sshhosts._pid_alive(pid) or sshhosts._is_zombie(pid)


CRASHER = """
import json, sys, time
import harness.sshd as sshhosts
f = sshhosts.SshdFarm()
hosts = [f.add_host("a")] + ([f.add_host("b", netns=True)] if f.netns_available else [])
print(json.dumps({"dir": str(f.directory), "pids": [h.sshd_pid for h in hosts],
                  "ns": [h.netns for h in hosts if h.netns]}), flush=True)
time.sleep(120)
"""


def test_leftovers_of_a_killed_process_are_cleaned():
    proc = subprocess.Popen([sys.executable, "-c", CRASHER], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while not all(gone(p) for p in info["pids"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(p) for p in info["pids"])  # parent-death signal
    with SshdFarm():  # the next farm to start removes the leftovers (or a concurrent run already did)
        pass
    assert not Path(info["dir"]).exists()
    assert not set(info["ns"]) & set(ns_list())
    assert not any(re.fullmatch(r"hsx[vst]\d+", l) and Path(f"/sys/class/net/{l}/ifalias").read_text().strip()
                   in info["ns"] for l in links())


@NEEDS_NETNS
def test_stale_namespaces_of_dead_processes_are_cleaned():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"hsx-{dead.pid}-99"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
    try:
        with SshdFarm():
            assert stale not in ns_list()
        sleeper.wait(timeout=5)  # the process inside was killed too
    finally:
        sleeper.kill()
        sleeper.wait()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
