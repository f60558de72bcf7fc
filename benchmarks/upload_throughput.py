"""Verified upload (hsextract.output.upload.upload_verified) vs plain boto3 upload_file, same files, same endpoint.

    .venv/bin/python benchmarks/upload_throughput.py [--files 16] [--mb 24] [--endpoint URL]

Without --endpoint a moto ThreadedMotoServer on a free loopback port is the endpoint (a real S3 HTTP
server, but in this process: its CPU competes with the client's, so the ratio is the figure, not MB/s).
Both runs use the same TransferConfig (8 MiB parts, 8 threads); the
verified one also reads each file once more for its sha256 and part digests and HEADs the object.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from hsextract.store import s3_client
from hsextract.output.upload import upload_verified

PART = 8 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--mb", type=int, default=24)
    ap.add_argument("--endpoint")
    args = ap.parse_args()
    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"), ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
    from boto3.s3.transfer import TransferConfig

    client = s3_client(endpoint)
    client.create_bucket(Bucket="bench")
    work = Path(tempfile.mkdtemp(prefix="hsx-upload-"))
    files = []
    for i in range(args.files):
        path = work / f"batch-{i:06d}.safetensors"
        path.write_bytes(os.urandom(args.mb << 20))
        files.append((path, hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size))
    total = sum(f[2] for f in files) / 2**20
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=8)
    results = {}
    for rnd in range(2):  # twice each, alternating, to even out warm-up
        t = time.monotonic()
        for path, _, _ in files:
            client.upload_file(str(path), "bench", f"plain/{rnd}/{path.name}", Config=config,
                               ExtraArgs={"ChecksumAlgorithm": "SHA256"})
        results.setdefault("plain", []).append(time.monotonic() - t)
        t = time.monotonic()
        for path, sha, size in files:
            upload_verified(client, path, "bench", f"verified/{rnd}/{path.name}", sha, size, part_size=PART,
                            concurrency=8, delete=False)
        results.setdefault("verified", []).append(time.monotonic() - t)
    plain, verified = min(results["plain"]), min(results["verified"])
    print(f"{args.files} files x {args.mb} MiB = {total:.0f} MiB to {endpoint} ({os.cpu_count()} CPU cores)")
    print(f"boto3 upload_file (SHA256 checksums):        {plain:6.2f} s  {total / plain:7.1f} MiB/s")
    print(f"upload_verified (+ local sha256, HEAD check): {verified:6.2f} s  {total / verified:7.1f} MiB/s")
    print(f"ratio verified / plain throughput: {plain / verified:.2f}")
    if server:
        server.stop()


if __name__ == "__main__":
    main()
