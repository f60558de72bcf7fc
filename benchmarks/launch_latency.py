"""How fast the orchestrator proves a launch, and how fast it notices a bad one.

    .venv/bin/python benchmarks/launch_latency.py [--hosts 8] [--gpus 4] [--heartbeat 1.0]

Real sshd hosts (network namespaces when available), a real Prefect server, the tiny model. Prints:
  1. flow start -> Failed for a launch that prints nothing and exits 0    (goal < 10 s)
  2. kill -9 of a running worker -> supervise says lost                   (goal < 2 heartbeat intervals)
  3. SIGSTOP of a running worker -> supervise says stalled                (goal < 2 heartbeat intervals)
  4. flow start -> all shards verified running, HOSTS x GPUS shards        (goal < 30 s), cold and warm
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from harness.inventory import ssh_host_entry, write_inventory  # noqa: E402
from harness.sshd import SshdFarm  # noqa: E402

from flows.extract import ROOT, extract  # noqa: E402
from tasks.bundle import build_bundle  # noqa: E402
from tasks.deploy import deploy_host  # noqa: E402
from tasks.hosts import connect  # noqa: E402
from tasks.inventory import parse_inventory  # noqa: E402
from hsextract.options import WorkerOptions  # noqa: E402
from tasks.shards import Deadlines, ShardFailed, ShardJob, launch_shard, probe, supervise_shard  # noqa: E402


def hsextract(*args):
    subprocess.run([sys.executable, "-m", "hsextract", *args], check=True, capture_output=True)


def silent_launch(work: Path, farm, model, data) -> float:
    wrapper = work / "silent-python"
    wrapper.write_text(f"#!/bin/sh\n[ \"$3\" = extract ] && exit 0\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    hosts = write_inventory(work / "silent.yaml", [ssh_host_entry(farm.host("b0"), work / "silent", gpus=[0],
                                                                  python=str(wrapper))])
    kwargs = dict(model=str(model), data=str(data), output=f"file://{work}/silent-out", hosts=str(hosts),
                  layers="1,3", poll_interval_s=0.5)
    extract(return_state=True, **kwargs)  # first call deploys the bundle; measure the launch path
    started = time.monotonic()
    state = extract(return_state=True, **kwargs)
    assert state.is_failed() and "printing no STARTED line" in str(state.message) + repr(state.data), state
    return time.monotonic() - started


def detection(work: Path, farm, model, data, heartbeat: float) -> tuple[float, float]:
    entry = ssh_host_entry(farm.host("b0"), work / "detect")
    inventory = parse_inventory(write_inventory(work / "detect.yaml", [entry]).read_text())
    deadlines = Deadlines(poll_interval_s=heartbeat / 4, stall_timeout_s=1.5 * heartbeat, command_timeout_s=5)
    times = []
    with connect(inventory.hosts[0], inventory) as host:
        deploy_host(host, build_bundle(ROOT), "0.1.0")
        for n, signal in enumerate(("KILL", "STOP")):
            options = WorkerOptions(model=model, data=data, out=f"{work}/detect-out-{n}", layers="1,3",
                                    token_budget=128, heartbeat_interval=heartbeat, device="cpu", progress="log")
            job = ShardJob.on(f"d{n}", inventory.hosts[0], 0, build_bundle(ROOT).sha256, options, 0, 1)
            launched = launch_shard(host, job, deadlines)
            while (probe(host, job, 5).heartbeat or {}).get("phase") != "extracting":
                time.sleep(0.1)
            host.run(f"kill -{signal} {launched.pid}", 5)
            acted = time.monotonic()
            try:
                supervise_shard(host, job, launched, deadlines)
            except ShardFailed:
                times.append(time.monotonic() - acted)
    return times[0], times[1]


def all_running(work: Path, farm, model, data, num_hosts: int, gpus: int, tag: str) -> tuple[float, float]:
    """Run the flow in a thread: (seconds from calling it until it logs that every shard is verified
    running, seconds of that from the first launch, as the flow's own log line says)."""
    import logging
    import re

    proved, launch_phase = threading.Event(), []

    class Watch(logging.Handler):
        def emit(self, record):
            if "verified running" in (text := record.getMessage()):
                launch_phase.append(float(re.search(r"([0-9.]+)s after the first launch", text).group(1)))
                proved.set()

    watch = Watch()
    flow_log = logging.getLogger("prefect.flow_runs")
    flow_log.setLevel(logging.INFO)  # the line we wait for is INFO; PREFECT_LOGGING_LEVEL quiets the rest
    flow_log.addHandler(watch)
    entries = [ssh_host_entry(farm.host(f"b{i}"), work / f"fleet-{i}", gpus=range(gpus)) for i in range(num_hosts)]
    hosts = write_inventory(work / "fleet.yaml", entries)
    thread = threading.Thread(target=extract, kwargs=dict(
        model=str(model), data=str(data), output=f"file://{work}/fleet-out-{tag}", hosts=str(hosts),
        layers="1,3", token_budget=64, return_state=True, run_name=f"fleet-{tag}"), daemon=True)
    started = time.monotonic()
    thread.start()
    assert proved.wait(timeout=300), "the flow never reported all shards verified running"
    elapsed = time.monotonic() - started
    logging.getLogger("prefect.flow_runs").removeHandler(watch)
    subprocess.run(["pkill", "-9", "-f", f"{work}/fleet-out-{tag}"])  # the point was the launch; stop them
    thread.join(timeout=120)
    return elapsed, launch_phase[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--heartbeat", type=float, default=1.0)
    args = ap.parse_args()
    from prefect.testing.utilities import prefect_test_harness

    work = Path(tempfile.mkdtemp(prefix="hsx-launch-"))
    model, data = work / "model", work / "data.jsonl"
    hsextract("make-tiny", "--model", str(model), "--data", str(data), "--samples", "3000")
    with SshdFarm() as farm, prefect_test_harness(server_startup_timeout=120):
        for i in range(args.hosts):
            farm.add_host(f"b{i}", netns=True)
        kind = "network namespaces" if farm.host("b0").netns else "loopback ports"
        silent = silent_launch(work, farm, model, data)
        killed, stalled = detection(work, farm, model, data, args.heartbeat)
        fleet = {tag: all_running(work, farm, model, data, args.hosts, args.gpus, tag) for tag in ("cold", "warm")}
    n = args.hosts * args.gpus
    print(f"\n{args.hosts} sshd hosts ({kind}), real Prefect server, heartbeat {args.heartbeat:.1f}s, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'measure':<76}{'seconds':>9}  goal")
    print(f"{'flow start -> Failed, launch prints nothing and exits 0':<76}{silent:>9.2f}  < 10")
    print(f"{'kill -9 -> lost':<76}{killed:>9.2f}  < {2 * args.heartbeat:.1f}")
    print(f"{'SIGSTOP -> stalled (and killed)':<76}{stalled:>9.2f}  < {2 * args.heartbeat:.1f}")
    for tag, (seconds, launching) in fleet.items():
        how = f"first deploy, {args.hosts} env checks" if tag == "cold" else "bundle in place"
        print(f"{f'flow start -> all {n} shards verified running, {how}':<76}{seconds:>9.2f}  < 30")
        print(f"{'  of which first launch -> all verified running':<76}{launching:>9.2f}")


if __name__ == "__main__":
    main()
