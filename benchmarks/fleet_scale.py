"""The orchestrator at fleet scale: many shards on many sshd hosts, synthetic workers, the real flow.

    .venv/bin/python benchmarks/fleet_scale.py [--hosts 8] [--gpus 4] [--rate 2000] [--samples 4000]

Real sshd hosts (network namespaces when available; each logs the connections it accepts), a real Prefect
server, the real `extract` flow with `synthetic_tokens_per_s` (`hsextract extract --synthetic`: no model, no
torch, the real files, journals and heartbeats). The bundle is deployed first (a run of its own), then the
measured run. Prints, for HOSTS x GPUS shards:
  - flow start -> all shards verified running (the flow's own log line)      (goal < 60 s at 256 shards)
  - SSH connections each host accepted during the measured run               (goal <= 2)
  - probe round trips a second (the flow's supervision line) and the run's wall time
  - the orchestrator's CPU (this process: the flow, its tasks and threads) and peak memory
Not yet measured here (issue 21): kill -9 and host-cut detection at scale, Prefect API requests a second.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.inventory import ssh_host_entry, write_inventory  # noqa: E402
from harness.sshd import SshdFarm  # noqa: E402

from flows.extract import extract  # noqa: E402


class FlowLines(logging.Handler):
    """The flow's INFO lines this benchmark reads: all shards verified running, and the supervision figures."""

    def __init__(self):
        super().__init__()
        self.proved_at: float | None = None
        self.launch_phase: float | None = None
        self.supervision: str = ""

    def emit(self, record):
        text = record.getMessage()
        if "verified running" in text and self.proved_at is None:
            self.proved_at = time.monotonic()
            self.launch_phase = float(re.search(r"([0-9.]+)s after the first launch", text).group(1))
        elif "supervised with" in text:
            self.supervision = text


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--rate", type=float, default=2000.0, help="each synthetic worker's tokens a second")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--poll", type=float, default=2.0, help="poll_interval_s")
    args = ap.parse_args()
    from prefect.testing.utilities import prefect_test_harness

    work = Path(tempfile.mkdtemp(prefix="hsx-fleet-"))
    model, data = work / "model", work / "data.jsonl"
    subprocess.run([sys.executable, "-m", "hsextract", "make-tiny", "--model", str(model), "--data", str(data),
                    "--samples", str(args.samples)], check=True, capture_output=True)
    shards = args.hosts * args.gpus
    lines = FlowLines()
    flow_log = logging.getLogger("prefect.flow_runs")
    flow_log.setLevel(logging.INFO)
    flow_log.addHandler(lines)
    with SshdFarm(log_level="INFO") as farm, prefect_test_harness(server_startup_timeout=120):
        names = [f"f{i}" for i in range(args.hosts)]
        for name in names:
            farm.add_host(name, netns=True)
        kind = "network namespaces" if farm.host(names[0]).netns else "loopback ports"
        hosts = write_inventory(work / "fleet.yaml", [ssh_host_entry(farm.host(n), work / f"w-{n}",
                                                                     gpus=range(args.gpus)) for n in names])
        common = dict(model=str(model), data=str(data), hosts=str(hosts), layers="1,3", token_budget=256,
                      synthetic_tokens_per_s=args.rate, poll_interval_s=args.poll, return_state=True)
        # the bundle and each host's environment check, once (a later run finds them in place)
        extract(output=f"file://{work}/warmup-out", run_name="warmup", shards=[0], **common)
        lines.proved_at = None
        before = {n: farm.connections(n) for n in names}
        cpu0, began = cpu_s(), time.monotonic()
        state = extract(output=f"file://{work}/out", run_name="fleet", **common)
        wall, cpu = time.monotonic() - began, cpu_s() - cpu0
        made = {n: farm.connections(n) - before[n] for n in names}
    ok = state.is_completed()
    trips = re.search(r"(\d+) probe round trip\(s\) to (\d+) host\(s\) in (\d+)s", lines.supervision)
    print(f"\n{shards} shards = {args.hosts} sshd hosts ({kind}) x {args.gpus} GPUs, synthetic workers at "
          f"{args.rate:g} tok/s, {args.samples} samples, poll {args.poll:g}s, real Prefect server, "
          f"{os.cpu_count()} CPU cores; the run {'completed' if ok else 'did NOT complete: ' + str(state.message)}")
    print(f"{'measure':<64}{'value':>12}  goal")
    if lines.proved_at is not None:
        print(f"{'flow start -> all shards verified running (s)':<64}{lines.proved_at - began:>12.1f}  < 60")
        print(f"{'  of which first launch -> all verified running (s)':<64}{lines.launch_phase:>12.1f}")
    print(f"{'SSH connections per host during the run (max)':<64}{max(made.values()):>12}  <= 2")
    if trips:
        n, h, s = (int(x) for x in trips.groups())
        print(f"{'probe round trips a second (all hosts)':<64}{n / max(1, s):>12.1f}  ({h} hosts x 1/{args.poll:g}s)")
    print(f"{'the run, wall (s)':<64}{wall:>12.1f}")
    print(f"{'orchestrator CPU over the run (cores)':<64}{cpu / wall:>12.2f}  < 0.5")
    print(f"{'orchestrator peak memory (MB)':<64}{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:>12.0f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
