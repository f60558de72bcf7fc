"""How long a user waits, through the deployment path, on the embedded default.

    .venv/bin/python benchmarks/deployment_latency.py [--repeats 3] [--slots 2] [--query-seconds 2]

A real `prefect server start` (SQLite, temporary home), the project's deployments and automations
registered with deployments/qwen.py, a real `prefect worker start` process, the local host, the tiny model.
Prints, per repeat and as a median:
  1. `prefect deployment run extract/qwen` invoked -> every shard verified running (extract.shard.running),
     with the split: CLI returned, the worker started the flow run, hosts deployed;
  2. a shard that fails (exits 0 printing nothing, once) -> its re-run running through the automation:
     from the failed run's end (Failed) and from the shard's own failure event.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from deployments.local import PrefectServer, start_worker, stop  # noqa: E402
from harness.prefect import flow_runs_for, run_events, wait_until  # noqa: E402
from hsextract import tiny  # noqa: E402

FAST = {"heartbeat_interval_s": 1.0, "poll_interval_s": 0.5, "status_interval_s": 2.0, "token_budget": 2048}


def inventory(work: Path, name: str, slots: int, python: str) -> str:
    import json

    path = work / f"{name}.json"
    path.write_text(json.dumps({"hosts": [{"name": "local", "hostname": "local", "gpus": list(range(slots)),
                                           "workdir": str(work / f"w-{name}"), "python": python}]}))
    return str(path)


def to_running(env: dict, client, work: Path, slots: int, i: int) -> dict:
    run = f"lat-{i}"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "extract/qwen", "--param",
                           f"run_name={run}", "--param", f"output=file://{work / ('out-' + run)}"],
                          capture_output=True, text=True, env={**os.environ, **env})
    t_cli = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"prefect deployment run failed:\n{proc.stdout}\n{proc.stderr}")
    running = wait_until(lambda: (lambda ev: ev if len({e.payload["shard"] for e in ev}) == slots else None)(
        run_events(client, "extract.shard.running", run)), 300, f"{slots} shards running ({run})", interval=0.2)
    t_running = max(e.occurred.timestamp() for e in running)
    flow_run = flow_runs_for(client, run)[0]
    launching = run_events(client, "extract.shard.launching", run)
    t_deployed = min(e.occurred.timestamp() for e in launching)
    wait_until(lambda: client.read_flow_run(flow_run.id).state.is_final(), 300, f"{run} to finish")
    return {"cli": t_cli - t0, "flow_started": flow_run.start_time.timestamp() - t0 if flow_run.start_time else
            client.read_flow_run(flow_run.id).start_time.timestamp() - t0,
            "deployed": t_deployed - t0, "all_running": t_running - t0}


def failure_to_rerun(client, work: Path, slots: int, i: int) -> dict:
    from prefect.deployments import run_deployment

    run = f"flaky-{i}"
    mark = work / f"failed-once-{i}"
    wrapper = work / f"python-flaky-{i}"
    wrapper.write_text(f"#!/bin/sh\ncase \" $* \" in *\" extract \"*\" --shard 0 \"*) [ ! -e {mark} ] && "
                       f"{{ touch {mark}; exit 0; }} ;; esac\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    first = run_deployment("extract/qwen", timeout=0, parameters={
        "run_name": run, "output": f"file://{work / ('out-' + run)}",
        "hosts": inventory(work, run, slots, str(wrapper))})
    wait_until(lambda: client.read_flow_run(first.id).state.is_final(), 300, f"{run} to fail")
    failed_run = client.read_flow_run(first.id)
    assert failed_run.state.is_failed(), failed_run.state
    rerun = wait_until(lambda: [r for r in flow_runs_for(client, run) if r.id != first.id and r.start_time], 120,
                 f"the automated re-run of {run}")[0]
    failure = run_events(client, "extract.shard.failed", run)[0]
    wait_until(lambda: client.read_flow_run(rerun.id).state.is_final(), 300, f"re-run of {run} to finish")
    done = client.read_flow_run(rerun.id)
    assert done.state.is_completed() and done.parameters["shards"] == [0], (done.state, done.parameters)
    return {"from_run_failed": rerun.start_time.timestamp() - failed_run.end_time.timestamp(),
            "from_shard_failed": rerun.start_time.timestamp() - failure.occurred.timestamp()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2, help="GPU slots of the local host (= shards)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--query-seconds", type=float, default=2.0, help="worker poll interval")
    args = ap.parse_args()
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.qwen import register

    with tempfile.TemporaryDirectory(prefix="hsx-deploy-lat-") as tmp:
        work = Path(tmp)
        model = tiny.build_model(work / "model")
        data = tiny.build_dataset(work / "chat.jsonl", args.samples, seed=3)
        started = time.monotonic()
        with PrefectServer(work / "prefect") as server, temporary_settings({PREFECT_API_URL: server.url}):
            print(f"prefect server up in {time.monotonic() - started:.1f}s at {server.url}")
            register(str(model), str(data), f"file://{work / 'out'}",
                     inventory(work, "hosts", args.slots, sys.executable), pool="hsextract-bench", overrides=FAST,
                     rerun_delay=timedelta(0))
            worker = start_worker("hsextract-bench", server.env, work / "worker.log", query_s=args.query_seconds)
            try:
                with get_client(sync_client=True) as client:
                    rows = [to_running(server.env, client, work, args.slots, i) for i in range(args.repeats)]
                    reruns = [failure_to_rerun(client, work, args.slots, i) for i in range(args.repeats)]
            finally:
                stop(worker)
    print(f"\n`prefect deployment run extract/qwen` -> all {args.slots} shards verified running "
          f"(embedded default: local host, tiny model; worker polls every {args.query_seconds:g}s)")
    print(f"{'repeat':>6} {'CLI returned':>13} {'flow started':>13} {'hosts deployed':>15} {'all running':>12}")
    for i, r in enumerate(rows):
        print(f"{i:>6} {r['cli']:>12.1f}s {r['flow_started']:>12.1f}s {r['deployed']:>14.1f}s {r['all_running']:>11.1f}s")
    print(f"{'median':>6} " + " ".join(f"{statistics.median(r[k] for r in rows):>{w}.1f}s" for k, w in
                                       (("cli", 12), ("flow_started", 12), ("deployed", 14), ("all_running", 11))))
    print("\nshard failure -> its re-run running, through the `extract.run.incomplete` automation")
    print(f"{'repeat':>6} {'from run Failed':>16} {'from shard failed':>18}")
    for i, r in enumerate(reruns):
        print(f"{i:>6} {r['from_run_failed']:>15.1f}s {r['from_shard_failed']:>17.1f}s")
    print(f"{'median':>6} {statistics.median(r['from_run_failed'] for r in reruns):>15.1f}s "
          f"{statistics.median(r['from_shard_failed'] for r in reruns):>17.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
