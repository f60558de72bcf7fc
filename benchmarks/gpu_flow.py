"""The `extract` flow on one GPU host, one shard per GPU slot: pinning, a kill and its re-run, scaling.

    python3 benchmarks/gpu_flow.py [--model-layers 4] [--samples 240] [--shards-per-gpu 1] [--json FILE]
    python3 benchmarks/gpu_flow.py --tiny --device cpu      # the same steps on the tiny model, no GPU

Imports the project's packages by name: installed (`pip install -e .`), or on a machine where it is not
(the GPU device), with `PYTHONPATH=src:.:tests` (hsextract; tasks, flows, deployments; harness).

The inventory is this machine (`hostname: local`), one entry per GPU slot: every GPU `nvidia-smi -L` lists,
`--shards-per-gpu` times (on a one-GPU machine, 2 shards then share it). A Qwen3.6-27B-shaped stack with
random bf16 weights (gpu_throughput.build_model) and a pre-tokenized lognormal dataset are built first.
After a warm-up run over the same data (Triton compiles the GDN kernels for each new shape on first use) and a probe of the disk's durable write
rate (the sink's ceiling), three runs of the flow, each through a real Prefect server (prefect_test_harness):
  1. one shard on GPU 0 alone: the one-GPU figure;
  2. every slot at once: per-shard and total tokens/s, scaling efficiency = total / (shards x one-shard
     figure, or GPUs x it when shards share GPUs), each worker's CUDA_VISIBLE_DEVICES, NCCL_NVLS_ENABLE and
     nvidia-smi's compute processes while they run;
  3. every slot again, shard `--kill` killed -9 once all are extracting: the flow must end Failed naming it,
     a re-run of that shard alone (same run name) must complete, and the output must hold every sample
     exactly once (the reader, checksums verified).
The workers run with `--confine on` (Landlock) unless `--confine` says otherwise. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def compute_apps() -> list[str]:
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return []


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def inventory(work: Path, slots: list[int], tag: str) -> str:
    from harness.inventory import write_inventory

    hosts = [{"name": f"gpu{gpu}-{i}", "hostname": "local", "gpus": [gpu], "workdir": str(work / f"w-{tag}-{i}"),
              "python": sys.executable} for i, gpu in enumerate(slots)]
    return str(write_inventory(work / f"{tag}.yaml", hosts))


class Runner:
    def __init__(self, args, work: Path, model: Path, data: Path):
        self.args, self.work, self.model, self.data = args, work, model, data

    def params(self, tag: str, slots: list[int]) -> dict:
        a = self.args
        return dict(model=str(self.model), data=str(self.data), output=f"file://{self.work / ('out-' + tag)}",
                    hosts=inventory(self.work, slots, tag), layers=a.layers, token_budget=a.token_budget,
                    device=a.device, dtype=a.dtype, run_name=tag, heartbeat_interval_s=0.25, poll_interval_s=0.5,
                    launch_timeout_s=300, stall_timeout_s=120, host_timeout_s=30, status_interval_s=5,
                    confine=a.confine)

    def flow(self, **params):
        from flows.extract import extract

        began = time.monotonic()
        state = extract(return_state=True, **params)
        return state, time.monotonic() - began

    def ctrl(self, tag: str, shard: int, n: int) -> Path:
        """The shard's control dir, on whichever slot (host entry) it landed."""
        found = list(self.work.glob(f"w-{tag}-*/runs/{tag}/shard-{shard:05d}-of-{n:05d}"))
        return found[0] if found else self.work / "nowhere"

    def wait_extracting(self, tag: str, n: int, box: dict, timeout: float = 600, shards=None,
                        files: int = 1) -> dict[int, int]:
        """{shard: pid} once each of `shards` (default all) says extracting, with `files` files written."""
        shards = set(range(n) if shards is None else shards)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and "state" not in box:
            pids = {}
            for shard in range(n):
                try:
                    beat = json.loads((self.ctrl(tag, shard, n) / "heartbeat.json").read_text())
                    if beat.get("phase") == "extracting" and beat.get("files", 0) >= files:
                        pids[shard] = int((self.ctrl(tag, shard, n) / "pid").read_text())
                except (OSError, ValueError):
                    pass
            if shards <= set(pids):
                return pids
            time.sleep(0.05)
        raise RuntimeError(f"run {tag}: not every shard reached extracting ({box.get('state')})")


def disk_write_gib_s(work: Path, size_mib: int = 2048) -> float:
    """This disk's sequential write rate with the data made durable (dd, fdatasync): the sink's ceiling."""
    target = work / "disk-probe"
    began = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={size_mib // 16}", "conv=fdatasync"],
                   capture_output=True, check=True)
    seconds = time.monotonic() - began
    target.unlink()
    return round(size_mib / 1024 / seconds, 3)


def summaries(out: Path) -> dict[int, dict]:
    from hsextract.output.journal import read_entries

    found = {}
    for journal in sorted(out.glob("shard-*/journal.jsonl")):
        done = [e for e in read_entries(journal) if e.get("kind") == "done"]
        if done:
            found[int(journal.parent.name[6:11])] = done[-1]["summary"]
    return found


def throughput(out: Path) -> dict:
    per = summaries(out)
    tokens = sum(s["tokens"] for s in per.values())
    slowest = max((s["extract_s"] for s in per.values()), default=0.0)
    return {"per_shard_tok_s": {k: s["tokens_per_s"] for k, s in sorted(per.items())},
            "tokens": tokens, "extract_s_slowest": slowest,
            "total_tok_s": round(tokens / slowest, 1) if slowest else 0.0,
            "confined": sorted({s.get("confined") for s in per.values()}, key=str)}


def exactly_once(out: Path, data: Path) -> dict:
    import hsextract

    want = Counter(json.loads(line)["id"] for line in data.read_text().splitlines() if line.strip())
    got = Counter(s["id"] for s in hsextract.read_samples(out, verify=True))
    return {"samples": sum(got.values()), "expected": sum(want.values()), "exactly_once": got == want,
            "missing": len(set(want) - set(got)), "duplicated": sum(1 for n in got.values() if n > 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-layers", type=int, default=4)
    ap.add_argument("--layers", default="1,2,3")
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--shards-per-gpu", type=int, default=0, help="default: 1, or 2 on a one-GPU machine")
    ap.add_argument("--kill", type=int, default=1, help="the shard killed in run 3")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--confine", default="on", choices=("auto", "on", "off"))
    ap.add_argument("--tiny", action="store_true", help="the tiny model and a chat dataset (CPU dry run)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)  # the workers inherit them (checked below)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    gpus = gpu_count() if args.device.startswith("cuda") else 1
    if gpus == 0:
        raise SystemExit("no GPU listed by nvidia-smi: run with --device cpu --tiny for a dry run")
    per_gpu = args.shards_per_gpu or (2 if gpus == 1 else 1)
    slots = [g for g in range(gpus) for _ in range(per_gpu)]
    work = Path(tempfile.mkdtemp(prefix="hsx-gpuflow-", dir=os.environ.get("HSX_WORK")))
    from hsextract import tiny

    started = time.monotonic()
    if args.tiny:
        model = tiny.build_model(work / "model", kind="qwen3_5_text")
        data = tiny.build_dataset(work / "data.jsonl", args.samples, seed=3)
    else:  # in a child: this process must hold no CUDA context (nvidia-smi would list it with the workers)
        model, data = work / "model", work / "data.jsonl"
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "  # run in benchmarks/
                        "from gpu_throughput import build_data, build_model; "
                        "build_model(Path(sys.argv[1]), int(sys.argv[2])); "
                        "build_data(Path(sys.argv[3]), int(sys.argv[4]))",
                        str(model), str(args.model_layers), str(data),
                        str(args.samples)], check=True, cwd=Path(__file__).parent)
    report = {"gpus": gpus, "shards_per_gpu": per_gpu, "slots": slots, "model_layers": args.model_layers,
              "layers": args.layers, "samples": args.samples, "confine": args.confine,
              "build_s": round(time.monotonic() - started, 1)}
    from prefect.testing.utilities import prefect_test_harness

    runner = Runner(args, work, model, data)
    report["disk_gib_s"] = disk_write_gib_s(work)
    with prefect_test_harness(server_startup_timeout=180):
        # 0. warm-up over the same data: Triton compiles the GDN kernels for each new shape on first use (tens
        # of seconds, kept in ~/.triton for the later runs); no figure is taken from it
        state, seconds = runner.flow(**runner.params("warm", [0]))
        report["warm_up"] = {"state": state.type.value, "seconds": round(seconds, 1),
                             "tok_s_while_compiling": throughput(work / "out-warm")["total_tok_s"]}
        shutil.rmtree(work / "out-warm")
        # 1. one shard alone on GPU 0
        state, seconds = runner.flow(**runner.params("one", [0]))
        report["one"] = {"state": state.type.value, "seconds": round(seconds, 1), **throughput(work / "out-one")}
        shutil.rmtree(work / "out-one")  # the disk holds a few runs' states, not all
        # 2. every slot at once, clean
        box: dict = {}
        thread = threading.Thread(target=lambda: box.update(zip(("state", "seconds"),
                                                                runner.flow(**runner.params("all", slots)))))
        thread.start()
        pids = runner.wait_extracting("all", len(slots), box, files=0)
        seen = {s: environ_of(pid) for s, pid in pids.items()}
        report["pinning"] = {s: {"pid": pids[s], "slot_gpu": slots[s],
                                 "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES"),
                                 **{k: env.get(k) for k in NO_MULTICAST}} for s, env in seen.items()}
        report["nvidia_smi_compute_apps"] = compute_apps()
        thread.join()
        report["all"] = {"state": box["state"].type.value, "seconds": round(box["seconds"], 1),
                         **throughput(work / "out-all")}
        shutil.rmtree(work / "out-all")
        one = report["one"]["total_tok_s"] or 1.0
        hidden = json.loads((model / "config.json").read_text())["hidden_size"]
        per_token = len(args.layers.split(",")) * hidden * 2  # bf16 bytes captured per token
        report["sink_ceiling_tok_s"] = round(report["disk_gib_s"] * 2**30 / per_token, 1)
        report["scaling"] = {
            "total_over_one": round(report["all"]["total_tok_s"] / one, 3),
            "efficiency_per_gpu": round(report["all"]["total_tok_s"] / (gpus * one), 3),
            "efficiency_per_shard": round(report["all"]["total_tok_s"] / (len(slots) * one), 3)}
        # 3. a shard killed mid-run, re-run alone
        box = {}
        params = runner.params("kill", slots)
        thread = threading.Thread(target=lambda: box.update(zip(("state", "seconds"), runner.flow(**params))))
        thread.start()
        pids = runner.wait_extracting("kill", len(slots), box, shards=[args.kill])
        os.kill(pids[args.kill], 9)
        killed_at = time.monotonic()
        thread.join()
        first = box["state"]
        try:
            first.result()
            why = ""
        except Exception as exc:  # noqa: BLE001 - the run's own error
            why = " ".join(str(exc).split())
        report["kill"] = {"shard": args.kill, "pid": pids[args.kill], "state": first.type.value,
                          "names_the_shard": f"shard {args.kill}/" in why, "reason": why[:400],
                          "ended_after_kill_s": round(time.monotonic() - killed_at, 1)}
        again, seconds = runner.flow(**{**params, "shards": [args.kill]})
        report["kill"]["rerun"] = {"state": again.type.value, "seconds": round(seconds, 1),
                                   "shards_run": sorted(again.result()["shards"]) if again.is_completed() else None}
        report["kill"]["output"] = exactly_once(work / "out-kill", data)
    report["total_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    ok = (report["one"]["state"] == report["all"]["state"] == "COMPLETED" and report["kill"]["state"] == "FAILED"
          and report["kill"]["names_the_shard"] and report["kill"]["rerun"]["state"] == "COMPLETED"
          and report["kill"]["output"]["exactly_once"]
          and all(p["CUDA_VISIBLE_DEVICES"] == str(p["slot_gpu"]) for p in report["pinning"].values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
