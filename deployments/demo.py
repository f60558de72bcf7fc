"""The embedded default, end to end: `python -m deployments.demo [--hosts inventory.yaml] [--served]`.

Builds a tiny random Qwen3.5 hybrid model and a chat dataset, runs the `extract` flow on this machine
(the local host, two slots) or on the SSH hosts of an inventory, writes to local storage (file://), then
counts and verifies what landed. By default the flow is called directly and Prefect starts a temporary
local server (unless PREFECT_API_URL is set). With --served it goes the way users run it: a Prefect server
(SQLite under the work directory), the deployments and automations of deployments/qwen.py, a process
worker, and `prefect deployment run extract/qwen --watch`; server and worker stay up for the UI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

from flows.extract import ROOT, extract
from hsextract.store import open_store

DEMO: dict[str, Any] = dict(layers="dflash:3", token_budget=2048, heartbeat_interval_s=1.0, poll_interval_s=0.5)


def hsextract(*args: str) -> dict:
    """Run `python -m hsextract ARGS`; its last line of output, parsed as JSON."""
    out = subprocess.run([sys.executable, "-m", "hsextract", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    """Build the tiny assets, run the flow (directly, or served), then count and verify what landed."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=ROOT / "demo-run")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--hosts", help="inventory YAML (default: this machine, 2 slots, no SSH)")
    ap.add_argument("--run-name", default="demo")
    ap.add_argument("--served", action="store_true",
                    help="through a Prefect server, the extract/qwen deployment and a worker, left running")
    args = ap.parse_args()
    work = args.workdir.resolve()
    assets = hsextract("make-tiny", "--model", str(work / "model"), "--data", str(work / "data.jsonl"),
                       "--samples", str(args.samples))
    hosts = args.hosts
    if hosts is None:
        hosts = str(work / "hosts.yaml")
        Path(hosts).write_text(json.dumps({"hosts": [{"name": "local", "hostname": "local", "gpus": [0, 1],
                                                      "workdir": str(work / "hostwork"), "python": sys.executable}]}))
    output = f"file://{work / 'out'}"
    if args.served:
        summary, ui = served(work, assets, output, hosts, args.run_name)
    else:
        summary, ui = extract(model=assets["model"], data=assets["data"], output=output, hosts=hosts,
                              run_name=args.run_name, **DEMO), None
    found = hsextract("inspect", "--verify", output)
    print(f"\nrun {summary['run_name']}: shards {summary['shards']}")
    rec = summary.get("reconcile", {})
    seal = "written" if rec.get("sealed") else "already there" if rec.get("already_sealed") else "NOT written"
    print(f"reconcile: {rec.get('done')} of {rec.get('expected')} samples stored, {rec.get('skipped')} skipped, "
          f"{rec.get('missing')} missing; _SUCCESS {seal}")
    print(f"{found['samples']} samples ({found['skipped']} skipped), {found['tokens_in_files']} tokens, "
          f"{found['files']} files, {found['bytes'] / 1e6:.1f} MB, checksums verified, under {found['out']}")
    print("read them:  .venv/bin/python -c \"import hsextract; s = next(hsextract.read_samples("
          f"'{found['out']}')); print(s['id'], s['hidden_states'].shape)\"")
    if ui:
        print(ui)
    else:
        print("see it in the UI:  bash scripts/demo.sh --served  (a Prefect server, the extract/qwen deployment "
              "and a worker, left running)")
    return 0


def served(work: Path, assets: dict, output: str, hosts: str, run_name: str) -> tuple[dict, str]:
    """Server (unless PREFECT_API_URL is set), deployments + automations, worker, `prefect deployment run`."""
    import os

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.local import PrefectServer, start_worker
    from deployments.qwen import register

    server = None
    if not os.environ.get("PREFECT_API_URL"):
        server = PrefectServer(work / "prefect").__enter__()  # left running: the UI is the point
    env = server.env if server else {"PREFECT_API_URL": os.environ["PREFECT_API_URL"]}
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        register(assets["model"], assets["data"], output, hosts, pool="hsextract-demo",  # the tiny model's
                 overrides={**DEMO, "max_length": 512, "dtype": "auto"})                 # recipe, not the 27B's
        worker = start_worker("hsextract-demo", env, work / "worker.log")
        proc = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "extract/qwen", "--watch",
                               "--param", f"run_name={run_name}"], env={**os.environ, **env}, text=True,
                              capture_output=True)
        print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:]))
        if proc.returncode != 0:
            raise SystemExit(f"prefect deployment run extract/qwen failed (rc {proc.returncode}): "
                             f"{last_state_message(run_name)}\nworker log: {work / 'worker.log'}")
        from prefect.artifacts import Artifact
        from prefect.client.schemas.objects import Artifact as ArtifactResponse

        from tasks.board import table_key

        table = cast("ArtifactResponse | None", Artifact.get(table_key(run_name)))  # sync here: not a coroutine
        rows = json.loads(cast(str, table.data)) if table else []  # a table artifact's data is its JSON text
    summary = {"run_name": run_name, "shards": {str(r["shard"]): r["state"] for r in rows}}
    try:  # the reconcile's summary, written when complete
        summary["reconcile"] = json.loads(open_store(output).read("_SUCCESS"))
    except FileNotFoundError:
        summary["reconcile"] = {}
    ui = env["PREFECT_API_URL"].removesuffix("/api")
    pids = " ".join(str(p) for p in ([server.process.pid] if server and server.process else []) + [worker.pid])
    return summary, (f"UI: {ui}  (flow runs, the shard table and progress artifacts, events)\n"
                     f"server and worker keep running (pids {pids}); stop them with:  kill {pids}")


def last_state_message(run_name: str) -> str:
    """The state message of the latest flow run of `run_name` (the flow tags its runs `run:<run_name>`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run_name}"])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=1)
    # a state's name is always set (Prefect fills it from its type), though typed optional
    return cast(str, runs[0].state.message or runs[0].state.name) if runs and runs[0].state else "no flow run found"


if __name__ == "__main__":
    sys.exit(main())
