"""The embedded default, end to end: `python -m flows.demo [--hosts inventory.yaml]`.

Builds a tiny random Qwen3.5 hybrid model and a chat dataset, runs the `extract` flow on this machine
(the local host, two slots) or on the SSH hosts of an inventory, writes to local storage (file://), then
counts and verifies what landed. Prefect starts a temporary local server unless PREFECT_API_URL is set.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.extract import extract  # noqa: E402


def hsextract(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "hsextract", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=ROOT / "demo-run")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--hosts", help="inventory YAML (default: this machine, 2 slots, no SSH)")
    ap.add_argument("--run-name", default="demo")
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
    summary = extract(model=assets["model"], data=assets["data"], output=output, hosts=hosts, layers="dflash:3",
                      run_name=args.run_name, token_budget=2048, heartbeat_interval_s=1.0, poll_interval_s=0.5)
    found = hsextract("inspect", "--verify", output)
    print(f"\nrun {summary['run_name']}: shards {summary['shards']}")
    rec = summary.get("reconcile", {})
    print(f"reconcile: {rec.get('done')} of {rec.get('expected')} samples stored, {rec.get('skipped')} skipped, "
          f"{rec.get('missing')} missing; _SUCCESS {'written' if rec.get('sealed') else 'already there' if rec.get('already_sealed') else 'NOT written'}")
    print(f"{found['samples']} samples ({found['skipped']} skipped), {found['tokens_in_files']} tokens, "
          f"{found['files']} files, {found['bytes'] / 1e6:.1f} MB, checksums verified, under {found['out']}")
    print("read them:  .venv/bin/python -c \"import hsextract; s = next(hsextract.read_samples("
          f"'{found['out']}')); print(s['id'], s['hidden_states'].shape)\"")
    print("see runs in the UI:  .venv/bin/prefect server start  (then export PREFECT_API_URL="
          "http://127.0.0.1:4200/api and run this again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
