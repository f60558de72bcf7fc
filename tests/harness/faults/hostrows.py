"""Rows that fault the hosts: deploy, launch and run (a worker killed, stopped, OOM-killed, hung; a host cut off,
rebooted, its disk full; host keys unknown or changed)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .. import faulty
from .lab import Case, Lab, Outcome, observed
from .storagerows import Store


def wrapper(case: Case, body: str, name: str = "python") -> str:
    """An interpreter that passes deploy's checks (it execs the real one) but first does `body` when asked to
    extract (`python -m hsextract extract ...`: "$3" is extract)."""
    path = case.base / name
    path.write_text(f"#!/bin/sh\nif [ \"$3\" = extract ]; then\n{body}\nfi\nexec {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def launch_fault(python_body: str | None = None, python: str | None = None, before=None):
    """A row whose launch goes wrong: detection from flow start; the re-run uses the real interpreter."""
    def run(lab: Lab, case: Case) -> Outcome:
        py = python or (wrapper(case, python_body) if python_body else None)
        hosts = case.inventory(("h1",), h1={"python": py} if py else {})
        if before:
            before(case)
        state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
        if before:  # undo what `before` did before the re-run
            getattr(before, "undo", lambda c: None)(case)
        took = case.launch_took(state)  # a deploy failure has no launch: flow start -> Failed then
        return case.finish(observed(state, why), seconds if took is None else took,
                           dict(hosts=case.inventory(tag="fixed")), case.local_out(),
                           note=f"flow start -> Failed {seconds:.1f}s" + (" (launch task)" if took else ""))
    return run


def log_dir_unwritable(case: Case) -> None:
    # root ignores permission bits: the log path is a directory, so the launch's `> worker.log` fails
    from hsextract.store import make_dirs

    make_dirs(case.control_dir("h1") / "worker.log")  # with the product's modes: the file_modes row checks this tree


log_dir_unwritable.undo = lambda case: shutil.rmtree(case.control_dir("h1") / "worker.log")


def clean_run(lab: Lab, case: Case) -> Outcome:
    state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(("h1", "h2"), gpus=(0,)))
    return case.finish(observed(state, why), None, {"hosts": case.inventory(("h1", "h2"))}, case.local_out(),
                       note=f"{seconds:.1f}s")


def signal_mid_run(sig: signal.Signals):
    def run(lab: Lab, case: Case) -> Outcome:
        case.data = lab.long_data
        box = case.flow_in_thread(output=case.local_out(), hosts=case.inventory(), token_budget=128)
        pid = case.wait_extracting("h1")
        os.kill(pid, sig)
        acted = time.time()
        box["thread"].join(300)
        failed_at = case.task_failed_at(box["state"])
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT) if _alive(pid) else None
        return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted,
                           {"hosts": case.inventory(tag="fixed")}, case.local_out())
    return run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def memory_cgroup(name: str) -> tuple[Path, str, str, Callable[[Path], str]]:
    """A fresh memory cgroup: (dir, limit file, usage file, oom-kill count reader), v2 or v1."""
    v2 = Path("/sys/fs/cgroup")
    if "memory" in ((v2 / "cgroup.controllers").read_text() if (v2 / "cgroup.controllers").exists() else ""):
        cg = v2 / name
        cg.mkdir()
        return cg, "memory.max", "memory.current", lambda d: _field(d / "memory.events", "oom_kill")
    cg = v2 / "memory" / name
    cg.mkdir()
    return cg, "memory.limit_in_bytes", "memory.usage_in_bytes", lambda d: _field(d / "memory.oom_control", "oom_kill")


def _field(path: Path, key: str) -> str:
    return dict(line.split() for line in path.read_text().splitlines() if line.strip()).get(key, "?")


def oom_kill(lab: Lab, case: Case) -> Outcome:
    """A memory cgroup around the worker. It uploads from memory over a slow link, so its files pile up in
    memory; once it extracts, its limit drops to what it uses plus 1 MiB: the kernel OOM-kills it (SIGKILL)."""
    cg, limit, usage, oom_kills = memory_cgroup(f"hsx-oom-{os.getpid()}-{case.run_name}")
    case.data = lab.long_data
    store = Store(lab, case, bandwidth=20_000)
    try:
        py = wrapper(case, f"echo $$ > {cg}/cgroup.procs")
        kwargs = dict(hosts=case.inventory(("lo",)), aws_credentials=store.block, upload_from="memory")
        box = case.flow_in_thread(output=store.output, token_budget=128,
                                  **{**kwargs, "hosts": case.inventory(("lo",), tag="oom", lo={"python": py})})
        case.wait_extracting("lo", files=0)  # from memory, a file is journaled only once stored: slow here
        time.sleep(1)
        (cg / limit).write_text(f"{int((cg / usage).read_text()) + (1 << 20)}\n")
        acted = time.time()
        box["thread"].join(300)
        failed_at = case.task_failed_at(box["state"])
        store.heal()
        return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted, kwargs,
                           store.output, client=store.client, note=f"kernel oom_kill count {oom_kills(cg)}")
    finally:
        store.close()
        for pid in (cg / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.3)
        cg.rmdir()


def cut_host(seconds: float):
    def run(lab: Lab, case: Case) -> Outcome:
        case.data = lab.long_data
        box = case.flow_in_thread(output=case.local_out(), hosts=case.inventory(("h1", "h2"), gpus=(0,)),
                                  token_budget=128, num_shards=2)
        case.wait_extracting("h1", 0, 2)
        lab.farm.cut("h1")
        acted = time.time()
        time.sleep(seconds)
        lab.farm.restore("h1")
        box["thread"].join(300)
        failed_at = case.task_failed_at(box["state"])
        return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted,
                           {"hosts": case.inventory(("h2",), tag="elsewhere")}, case.local_out(),
                           note=f"cut {seconds:.0f}s; re-run on h2 only")
    return run


def reboot(lab: Lab, case: Case) -> Outcome:
    """Every process of the host's shard gone and sshd down for a while; the files stay."""
    case.data = lab.long_data
    box = case.flow_in_thread(output=case.local_out(), hosts=case.inventory(), token_budget=128)
    pid = case.wait_extracting("h1")
    lab.farm.stop("h1")
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    acted = time.time()
    time.sleep(2)
    lab.farm.start("h1")
    box["thread"].join(300)
    failed_at = case.task_failed_at(box["state"])
    return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted,
                       {"hosts": case.inventory(tag="fixed")}, case.local_out(), note="sshd down 2s")


def duplicate_launch(lab: Lab, case: Case) -> Outcome:
    case.data = lab.long_data
    hosts = case.inventory()
    first = case.flow_in_thread(output=case.local_out(), hosts=hosts, token_budget=128)
    case.wait_extracting("h1")
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts, token_budget=128)  # same options
    first["thread"].join(300)
    both = "Completed" if state.is_completed() and first["state"].is_completed() else \
        f"Failed: second: {why or 'ok'}; first: {first['reason'] or 'ok'}"
    return case.finish(both, None, None, case.local_out(), note="second run adopted the first's worker")


def wrong_bundle(lab: Lab, case: Case) -> Outcome:
    """The bundle's bytes arrive altered (its hash no longer matches): nothing of it may be unpacked or run."""
    import dataclasses

    from flows.extract import ROOT
    from tasks.bundle import build_bundle
    from tasks.deploy import DeployFailed, deploy_host
    from tasks.hosts import connect
    from tasks.inventory import load_inventory

    inventory = load_inventory(case.inventory())
    bundle = build_bundle(ROOT)
    altered = dataclasses.replace(bundle, data=bundle.data[:-64] + bytes(64))
    began = time.monotonic()
    try:
        with connect(inventory.hosts[0], inventory) as host:
            deploy_host(host, altered, "0.1.0", timeout=30)
        seen = "Completed"
    except DeployFailed as exc:
        seen = f"Failed: {' '.join(exc.evidence.split())}"
    seconds = time.monotonic() - began
    unpacked = (case.workdir("h1") / "bundles" / bundle.sha256).exists()
    return case.finish(seen, seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out(),
                       note="altered bundle unpacked!" if unpacked else "nothing unpacked")


def deploy_put_fails(lab: Lab, case: Case) -> Outcome:
    blocker = case.base / "not-a-dir"
    blocker.write_text("a file where the workdir's parent should be\n")
    hosts = case.inventory(h1={"workdir": blocker / "w"})
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
    return case.finish(observed(state, why), seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out())


@contextlib.contextmanager
def tmpfs(mount: Path, size: str):
    """A small disk of its own (root: CI runs as root), unmounted after."""
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def deploy_disk_full(lab: Lab, case: Case) -> Outcome:
    with tmpfs(case.base / "tiny-disk", "64k") as mount:
        # `lo`: a host in a network namespace has its own mount namespace and would not see this mount
        state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(("lo",),
                                                                                      lo={"workdir": mount / "w"}))
    return case.finish(observed(state, why), seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out())


def out_disk_full(lab: Lab, case: Case) -> Outcome:
    with tmpfs(case.base / "small-disk", "3m") as mount:
        case.data = lab.long_data
        output = f"file://{mount / 'out'}"
        state, seconds, why = case.flow(output=output, hosts=case.inventory(("lo",)))  # lo: sees this mount
        subprocess.run(["mount", "-o", "remount,size=256m", str(mount)], check=True)
        return case.finish(observed(state, why), None, {"hosts": case.inventory(("lo",), tag="fixed")}, output,
                           note="re-run after the disk grew")


def hung(lab: Lab, case: Case) -> Outcome:
    """The forward loop hangs (a wedged GPU, a deadlock) while the heartbeat thread goes on beating."""
    hold = case.base / "hold"
    hold.touch()
    py = faulty.python_for(case.base / "python-held", {faulty.HOLD_WHILE: str(hold)})
    box = case.flow_in_thread(output=case.local_out(), hosts=case.inventory(h1={"python": py}), token_budget=128,
                              progress_timeout_s=4)
    case.wait_extracting("h1", files=0)
    acted = time.time()  # it holds at its first batch: no sample finishes from here on
    box["thread"].join(300)
    hold.unlink()
    failed_at = case.task_failed_at(box["state"])
    return case.finish(observed(box["state"], box["reason"]), failed_at and failed_at - acted,
                       {"hosts": case.inventory(tag="fixed")}, case.local_out(), note="progress_timeout_s 4")


def host_key(kind: str):
    """The inventory's known_hosts lacks the host's key, or holds another one: nothing may connect."""
    def run(lab: Lab, case: Case) -> Outcome:
        farm = lab.farm
        known = farm.known_hosts_without("h1") if kind == "unknown" else farm.known_hosts_with_wrong_key("h1")
        state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(h1={"known_hosts": str(known)}))
        launched = any(t.name.startswith(("deploy-", "launch-")) and t.state.is_completed()
                       for t in case.task_runs(state))
        return case.finish(observed(state, why), seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out(),
                           note="nothing deployed or launched" if not launched else "a task got through!")
    return run
