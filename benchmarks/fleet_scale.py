"""The orchestrator at fleet scale: many shards on many sshd hosts, synthetic workers, the real flow.

    .venv/bin/python benchmarks/fleet_scale.py [--hosts 8] [--gpus 4] [--duration 150] [--samples 4000]

Real sshd hosts (network namespaces when available; each logs the connections it accepts), a real Prefect
server, the real `extract` flow with `synthetic_tokens_per_s` (`hsextract extract --synthetic`: no model, no
torch, the real files, journals and heartbeats). The bundle is deployed first (a run of its own, which also
measures a shard's tokens), then the measured run, whose workers each take about `--duration` seconds (the rate
is set from the shard's tokens; ~20 batch files each). Once all are verified running, one worker is killed with
SIGKILL and one other host is cut off the network. Prints, for HOSTS x GPUS shards:
  - flow start -> all shards verified running (the flow's own log line)      (goal < 60 s at 256 shards)
  - SSH connections each host accepted during the measured run               (goal <= 2)
  - probe round trips a second (the flow's supervision line) and the run's wall time
  - kill -9 of one worker -> its shard failed                                (goal <= 2 poll intervals)
  - host cut off -> all its shards failed                                    (goal <= host_timeout_s + 10 s),
    and every other shard done
  - Prefect API requests a second from the flow (HTTP requests and events this process sent)
  - the orchestrator's CPU (this process: the flow, its tasks and threads) and peak memory
The hosts' side (sshd, the workers) shares this machine's cores with the orchestrator; on a real fleet each
host has its own.
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import logging
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from harness.inventory import ssh_host_entry, write_inventory
from harness.sshd import SshdFarm

from flows.extract import extract


class ApiCalls:
    """Counts the Prefect API traffic this process sends: HTTP requests (httpx, sync and async) and events
    (Prefect's events client). Instrumentation of the real clients: every call still goes through."""

    def __init__(self):
        import httpx
        from prefect.events.clients import EventsClient

        self.http = self.events = 0
        self.lock = threading.Lock()
        counter = self

        def bump(attr):
            with counter.lock:
                setattr(counter, attr, getattr(counter, attr) + 1)

        def count(cls, name, attr):
            original = getattr(cls, name)
            if getattr(original, "_counted", False):
                return
            if inspect.iscoroutinefunction(original):
                async def wrapped(self, *a, **k):
                    bump(attr)
                    return await original(self, *a, **k)
            else:
                def wrapped(self, *a, **k):
                    bump(attr)
                    return original(self, *a, **k)
            wrapped._counted = True
            setattr(cls, name, wrapped)

        count(httpx.AsyncClient, "send", "http")
        count(httpx.Client, "send", "http")
        count(EventsClient, "emit", "events")

    def snapshot(self) -> tuple[int, int]:
        return self.http, self.events


class FlowLines(logging.Handler):
    """The flow's lines this benchmark reads: all shards verified running, the supervision figures, and each
    shard's end (failed, with why; done)."""

    def __init__(self):
        super().__init__()
        self.proved_at: float | None = None
        self.launch_phase: float | None = None
        self.supervision: str = ""
        self.failed: dict[int, tuple[float, str, str]] = {}  # shard -> (when, host, why)
        self.done: set[int] = set()

    def emit(self, record):
        text = record.getMessage()
        if "verified running" in text and self.proved_at is None:
            self.proved_at = time.monotonic()
            self.launch_phase = float(re.search(r"([0-9.]+)s after the first launch", text).group(1))
        elif "supervised with" in text:
            self.supervision = text
        elif m := re.match(r"shard (\d+)/\d+ on (\S+) \(GPU \d+\) failed: (.*)", text):
            self.failed.setdefault(int(m.group(1)), (time.monotonic(), m.group(2), m.group(3)))
        elif m := re.match(r"shard (\d+)/\d+ on \S+ \(GPU \d+\): done:", text):
            self.done.add(int(m.group(1)))


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def shard_tokens(out: Path) -> int:
    """Tokens the shard(s) under `out` journaled (the warm-up run's one shard)."""
    return sum(json.loads(line).get("tokens", 0) for path in glob.glob(f"{out}/**/journal.jsonl", recursive=True)
               for line in open(path) if '"kind": "file"' in line or '"kind":"file"' in line)


def faults(lines: FlowLines, farm, work: Path, killed: str, cut: str, t: dict) -> None:
    """Once every shard is verified running and supervised a while: SIGKILL one worker of host `killed`, and cut
    host `cut` off the network (its workers run on). Their times go to `t`."""
    while lines.proved_at is None:
        time.sleep(0.2)
    time.sleep(10)
    pids = sorted(glob.glob(f"{work}/w-{killed}/runs/fleet/shard-*/pid"))
    t["victim"] = int(re.search(r"shard-(\d+)-of", pids[0]).group(1))
    t["killed_at"] = time.monotonic()
    os.kill(int(Path(pids[0]).read_text()), 9)  # the hosts' namespaces share this machine's pids
    farm.cut(cut)
    t["cut_at"] = time.monotonic()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--duration", type=float, default=150.0, help="each worker's seconds of work (sets the rate)")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--poll", type=float, default=2.0, help="poll_interval_s")
    ap.add_argument("--host-timeout", type=float, default=60.0, help="host_timeout_s")
    ap.add_argument("--no-faults", action="store_true", help="no kill -9, no host cut")
    args = ap.parse_args()
    from prefect.testing.utilities import prefect_test_harness

    work = Path(tempfile.mkdtemp(prefix="hsx-fleet-"))
    model, data = work / "model", work / "data.jsonl"
    subprocess.run([sys.executable, "-m", "hsextract", "make-tiny", "--model", str(model), "--data", str(data),
                    "--samples", str(args.samples)], check=True, capture_output=True)
    shards = args.hosts * args.gpus
    lines = FlowLines()
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(lines)
    api = ApiCalls()
    times: dict = {}
    with SshdFarm(log_level="INFO") as farm, prefect_test_harness(server_startup_timeout=120):
        names = [f"f{i}" for i in range(args.hosts)]
        for name in names:
            farm.add_host(name, netns=True)
        netns = farm.host(names[0]).netns is not None
        hosts = write_inventory(work / "fleet.yaml", [ssh_host_entry(farm.host(n), work / f"w-{n}",
                                                                     gpus=range(args.gpus)) for n in names])
        common = dict(model=str(model), data=str(data), hosts=str(hosts), layers="1,3", poll_interval_s=args.poll,
                      host_timeout_s=args.host_timeout, return_state=True)
        # the bundle and each host's environment check, once (a later run finds them in place); and the tokens
        # of one shard, which set the measured run's rate and batch size
        extract(output=f"file://{work}/warmup-out", run_name="warmup", shards=[0], token_budget=256,
                synthetic_tokens_per_s=1e6, **common)
        tokens = shard_tokens(work / "warmup-out")
        rate, budget = tokens / args.duration, max(64, tokens // 20)
        lines.proved_at, lines.failed, lines.done = None, {}, set()
        if not args.no_faults:
            threading.Thread(target=faults, args=(lines, farm, work, names[0], names[1], times), daemon=True).start()
        before = {n: farm.connections(n) for n in names}
        api0, cpu0, began = api.snapshot(), cpu_s(), time.monotonic()
        state = extract(output=f"file://{work}/out", run_name="fleet", synthetic_tokens_per_s=rate,
                        token_budget=budget, **common)
        wall, cpu = time.monotonic() - began, cpu_s() - cpu0
        http, events = (b - a for a, b in zip(api0, api.snapshot()))
        made = {n: farm.connections(n) - before[n] for n in names}
        if times.get("cut_at"):
            farm.restore(names[1])
    trips = re.search(r"(\d+) probe round trip\(s\) to (\d+) host\(s\) in (\d+)s", lines.supervision)
    print(f"\n{shards} shards = {args.hosts} sshd hosts ({'network namespaces' if netns else 'loopback'}) x "
          f"{args.gpus} GPUs, synthetic workers ({tokens} tokens a shard at {rate:.0f} tok/s, token budget {budget}: "
          f"~{args.duration:.0f}s each), poll {args.poll:g}s, host_timeout {args.host_timeout:g}s, real Prefect "
          f"server, {os.cpu_count()} CPU cores; the run ended {state.type.value}: {str(state.message)[:300]}")
    print(f"{'measure':<64}{'value':>12}  goal")
    if lines.proved_at is not None:
        print(f"{'flow start -> all shards verified running (s)':<64}{lines.proved_at - began:>12.1f}  < 60")
        print(f"{'  of which first launch -> all verified running (s)':<64}{lines.launch_phase:>12.1f}")
    print(f"{'SSH connections per host during the run (max)':<64}{max(made.values()):>12}  <= 2")
    if trips:
        n, h, s = (int(x) for x in trips.groups())
        print(f"{'probe round trips a second (all hosts)':<64}{n / max(1, s):>12.1f}  ({h} hosts x 1/{args.poll:g}s)")
    ok = True
    if "killed_at" in times:
        victim = times["victim"]
        when, _, why = lines.failed.get(victim, (None, "", ""))
        cut_shards = {n: v for n, v in lines.failed.items() if v[1] == names[1]}
        others = shards - 1 - args.gpus
        print(f"{'kill -9 of one worker -> its shard failed (s)':<64}"
              f"{(when - times['killed_at']) if when else float('nan'):>12.1f}  <= {2 * args.poll:g}"
              f"   ({why[:70]})")
        last = max((v[0] for v in cut_shards.values()), default=None)
        print(f"{f'host cut off -> all {len(cut_shards)}/{args.gpus} of its shards failed (s)':<64}"
              f"{(last - times['cut_at']) if last else float('nan'):>12.1f}  <= {args.host_timeout + 10:g}")
        print(f"{'the other shards done':<64}{len(lines.done):>12}  {others}")
        ok = when is not None and len(cut_shards) == args.gpus and len(lines.done) == others
    else:
        ok = state.is_completed()
    print(f"{'Prefect API: HTTP requests a second (the flow)':<64}{http / wall:>12.1f}  ({http} in all)")
    print(f"{'Prefect API: events a second (the flow)':<64}{events / wall:>12.1f}  ({events} in all)")
    print(f"{'the run, wall (s)':<64}{wall:>12.1f}")
    print(f"{'orchestrator CPU over the run (cores)':<64}{cpu / wall:>12.2f}  < 0.5")
    print(f"{'orchestrator peak memory (MB)':<64}{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:>12.0f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
