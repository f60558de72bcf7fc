"""Extract+upload wall time vs max(extract alone, upload alone) (goal <= 1.1x).

    .venv/bin/python benchmarks/extract_upload_overlap.py [--samples 600] [--budget 4096] [--repeats 3]
    PYTHONPATH=src python3 benchmarks/extract_upload_overlap.py --device cuda --samples 3000   # GPU host
On a GPU host with no package index, carry boto3/moto as wheels: here `pip download -d wheels --python-version
3.12 --only-binary=:all: --platform manylinux2014_x86_64 boto3 moto flask flask-cors xmltodict responses`,
there `python3 -m pip install --no-index --no-deps wheels/*.whl`.

The endpoint is moto's server in its own process on a free loopback port (a real S3 HTTP server). Runs:
  1. extract alone: the worker CLI with --out to a local directory;
  2. upload alone: the files of run 1 sent by the worker's own BackgroundUploader, all submitted at once
     (the same uploader with no extraction beside it);
  3. extract+upload: the worker CLI with --out s3://, the background uploader overlapping extraction.
  4. the same with --upload-from memory: files go from memory to the store, the spool only as overflow
     (the summary says how many files went from memory and the most bytes held).
All four are whole-process wall times, repeated and interleaved (drift on a shared machine hits every
run alike); ratios are of the medians, for whole processes and without the worker's start-up (imports,
model load: the same in every run, before any file exists, so no uploader can overlap it; on a real run
it is a minute against hours). Two links:
  - loopback: straight to moto. Uploading costs a fraction of extracting, so the ratio shows the fixed
    costs of the uploader and the CPU that the uploader and the S3 server take from a CPU extraction
    (on a GPU host the forward pass does not need those cores);
  - limited: through a proxy whose one shared link is set so that uploading alone takes as long as the
    forward loop that writes the files (the worker's start-up, imports and model load, comes first and
    makes no files, so no uploader can overlap it); the case the background uploader exists for.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hsextract.store import S3Store, s3_client
from hsextract.output.upload import BackgroundUploader, Spool
from harness.s3proxy import FaultProxy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str) -> tuple[float, dict]:
    """Wall seconds of one worker process, and its summary (for `make-tiny`: {})."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hsextract", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"hsextract {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    wall = time.monotonic() - started
    _, found, rest = proc.stdout.partition("SUMMARY ")
    return wall, json.loads(rest.splitlines()[0]) if found else {}


def journal_files(shard: Path) -> list[dict]:
    return [json.loads(l) for l in (shard / "journal.jsonl").read_text().splitlines() if '"kind":"file"' in l]


def measure(name: str, endpoint: str, common: tuple, work: Path, repeats: int) -> dict:
    """Per repeat: whole-process walls (`alone`, `upload`, `both`) and the same without the worker's
    start-up (`alone_loop`: the forward loop; `both_loop`: the forward loop + waiting for the last uploads)."""
    client = s3_client(endpoint)
    r: dict[str, list[float]] = {k: [] for k in ("alone", "upload", "both", "alone_loop", "both_loop", "mem",
                                                  "mem_loop", "mem_files", "mem_max_mib")}
    for rep in range(repeats):
        local = work / f"{name}-local-{rep}"
        wall, summary = cli("extract", *common, "--out", str(local))
        r["alone"].append(wall)
        r["alone_loop"].append(summary["extract_s"])
        shard = local / "shard-00000-of-00001"
        started = time.monotonic()  # the worker's own uploader, every file submitted at once
        uploader = BackgroundUploader(S3Store(f"s3://overlap/{name}-alone-{rep}", client), shard, Spool(1 << 40, 1 << 40),
                                      part_size=8 << 20)
        for e in journal_files(shard):
            uploader.submit(e)
        uploader.drain()
        uploader.mirror_journal()
        r["upload"].append(time.monotonic() - started)
        wall, summary = cli("extract", *common, "--out", f"s3://overlap/{name}-both-{rep}", "--spool",
                            str(work / f"{name}-spool-{rep}"), "--s3-endpoint", endpoint, "--upload-part-mb", "8")
        r["both"].append(wall)
        r["both_loop"].append(summary["extract_s"] + summary["upload"]["drain_s"])
        wall, summary = cli("extract", *common, "--out", f"s3://overlap/{name}-mem-{rep}", "--spool",
                            str(work / f"{name}-mspool-{rep}"), "--s3-endpoint", endpoint, "--upload-part-mb", "8",
                            "--upload-from", "memory", "--upload-memory-gb", "1")
        r["mem"].append(wall)
        r["mem_loop"].append(summary["extract_s"] + summary["upload"]["drain_s"])
        r["mem_files"].append(summary["upload"]["from_memory"] / summary["files"])
        r["mem_max_mib"].append(summary["upload"]["max_memory_bytes"] / 2**20)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host (the forward off the CPU cores)")
    args = ap.parse_args()
    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"), ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    work = Path(tempfile.mkdtemp(prefix="hsx-overlap-"))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    proxy = None
    try:
        client = s3_client(endpoint)
        for _ in range(100):
            try:
                client.create_bucket(Bucket="overlap")
                break
            except Exception:
                time.sleep(0.1)
        model, data = work / "model", work / "data.jsonl"
        cli("make-tiny", "--model", str(model), "--data", str(data), "--samples", str(args.samples))
        common = ("--model", str(model), "--data", str(data), "--layers", "1,3,5", "--shard", "0", "--num-shards",
                  "1", "--token-budget", str(args.budget), "--device", args.device, "--progress", "log")
        results = {"loopback": measure("loopback", endpoint, common, work, args.repeats)}
        files = journal_files(work / "loopback-local-0" / "shard-00000-of-00001")
        total = sum(e["bytes"] for e in files)
        # the link that makes uploading alone take as long as the forward loop that makes the files
        bandwidth = total / statistics.median(results["loopback"]["alone_loop"])
        proxy = FaultProxy(endpoint, bandwidth=bandwidth).start()
        results["limited"] = measure("limited", proxy.url, common, work, args.repeats)
    finally:
        if proxy:
            proxy.stop()
        server.terminate()
        server.wait()

    def runs(xs: list[float]) -> str:
        return f"{statistics.median(xs):6.2f} s  (runs: {', '.join(f'{x:.2f}' for x in xs)})"

    print(f"{args.samples} samples, {len(files)} files, {total / 2**20:.0f} MiB, moto server process, "
          f"{os.cpu_count()} CPU cores, device {args.device}, median of {args.repeats}")
    for name, r in results.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        link = "loopback to moto" if name == "loopback" else f"one link of {bandwidth / 2**20:.1f} MiB/s"
        print(f"\n[{name}: {link}]")
        print(f"  extract alone (local output):   {runs(r['alone'])}")
        print(f"    its forward loop:             {runs(r['alone_loop'])}")
        print(f"  upload alone (same uploader):  {runs(r['upload'])}")
        print(f"  extract + upload (--out s3://): {runs(r['both'])}")
        print(f"    forward loop + last uploads:  {runs(r['both_loop'])}")
        print(f"  same, --upload-from memory:     {runs(r['mem'])}")
        print(f"    forward loop + last uploads:  {runs(r['mem_loop'])}")
        print(f"    files from memory: {statistics.median(r['mem_files']):.0%}, most held "
              f"{max(r['mem_max_mib']):.0f} MiB (budget 1024)")
        serial = (med["alone_loop"] + med["upload"]) / max(med["alone_loop"], med["upload"])
        print(f"  whole processes: ratio to max(extract, upload) {med['both'] / max(med['alone'], med['upload']):.2f}")
        print(f"  without start-up: ratio to max(extract, upload) "
              f"{med['both_loop'] / max(med['alone_loop'], med['upload']):.2f}   goal <= 1.1 "
              f"(one after the other: {serial:.2f}); from memory "
              f"{med['mem_loop'] / max(med['alone_loop'], med['upload']):.2f}")

if __name__ == "__main__":
    main()
