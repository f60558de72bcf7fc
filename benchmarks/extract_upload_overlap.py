"""Extract+upload wall time vs max(extract alone, upload alone) (goal <= 1.1x).

    .venv/bin/python benchmarks/extract_upload_overlap.py [--samples 600] [--budget 4096]

The endpoint is moto's server in its own process on a free loopback port (a real S3 HTTP server). Runs:
  1. extract alone: the worker CLI with --out to a local directory;
  2. upload alone: the files of run 1 sent with `upload_verified` one after the other (what the
     background uploader does, on its own);
  3. extract+upload: the worker CLI with --out s3://, the background uploader overlapping extraction.
All three are whole-process wall times. On a 2-core machine the worker, the uploader's hashing and the
S3 server share the same cores, so the overlap here is a lower bound for a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hsextract.upload import s3_client, upload_verified  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str) -> float:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hsextract", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"hsextract {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--budget", type=int, default=4096)
    args = ap.parse_args()
    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"), ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    work = Path(tempfile.mkdtemp(prefix="hsx-overlap-"))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
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
                  "1", "--token-budget", str(args.budget), "--device", "cpu", "--progress", "log")
        alone = cli("extract", *common, "--out", str(work / "local"))
        shard = work / "local" / "shard-00000-of-00001"
        entries = [json.loads(l) for l in (shard / "journal.jsonl").read_text().splitlines() if '"kind":"file"' in l]
        started = time.monotonic()
        for e in entries:
            upload_verified(client, shard / e["file"], "overlap", f"alone/{e['file']}", e["sha256"], e["bytes"],
                            part_size=8 << 20, delete=False)
        upload = time.monotonic() - started
        both = cli("extract", *common, "--out", "s3://overlap/both", "--spool", str(work / "spool"),
                   "--s3-endpoint", endpoint, "--upload-part-mb", "8")
    finally:
        server.terminate()
        server.wait()
    mb = sum(e["bytes"] for e in entries) / 2**20
    print(f"{args.samples} samples, {len(entries)} files, {mb:.0f} MiB, moto server process, {os.cpu_count()} CPU cores")
    print(f"extract alone (local output):       {alone:7.2f} s")
    print(f"upload alone (upload_verified):     {upload:7.2f} s")
    print(f"extract + upload (--out s3://):     {both:7.2f} s")
    print(f"ratio to max(extract, upload): {both / max(alone, upload):.2f}   goal <= 1.1")


if __name__ == "__main__":
    main()
