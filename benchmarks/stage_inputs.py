"""Staging a model and a dataset onto a fleet: from S3 and from the orchestrator, against a raw copy of the same bytes.

    .venv/bin/python benchmarks/stage_inputs.py [--hosts 8] [--model-gib 2] [--data-gib 1] [--file-mib 256]

Real sshd hosts in network namespaces (tests/harness/sshd.py), each with the bundle deployed; a real S3 endpoint
(moto's server, in a process of its own, objects held in memory, ranged GETs reading only their range:
tests/harness/s3range.py; plain moto copies the whole object for every ranged GET). The model is
`config.json` + safetensors-sized files of random bytes (`--file-mib` each), the dataset JSONL files of chat
records. For each path:

  - S3 -> hosts. Raw: on every host at once, boto3's `download_file` of every object (its transfer manager, the
    same ranged-GET size and concurrency), nothing else. Staged: `tasks.stage.stage_host` on every host at once
    (the flow's `stage` task): the manifest, the space check, the host's `hsextract stage fetch` (ranged GETs
    written and hashed in order), the digests compared across hosts, the manifest written next to the source.
  - orchestrator -> hosts over SSH. Raw: the files written over each host's SFTP session, the same way staging
    sends them (`Host.append_file`), and OpenSSH's `scp` for reference. Staged: `stage_host` with
    `orchestrator:` sources (SFTP, then `hsextract stage place` verifies each file on the host).
  - the second staging of each (the same sources again): goal seconds, nothing sent.

Goal (issue 22): staged bytes/s >= 0.8 x the raw copy's over the same path. On this 2-core machine the hosts,
sshd, moto (one core at most: Python) and the orchestrator share the two cores: the figures are for the ratio,
not for a real network.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "src")]

from harness.inventory import ssh_host_entry, write_inventory  # noqa: E402
from harness.sshd import SshdFarm  # noqa: E402

from tasks.bundle import build_bundle  # noqa: E402
from tasks.credentials import S3Access  # noqa: E402
from tasks.deploy import deploy_host  # noqa: E402
from tasks.hosts import connect  # noqa: E402
from tasks.inventory import parse_inventory  # noqa: E402
from tasks.stage import resolve_sources, settle_manifests, stage_host  # noqa: E402

BUCKET = "inputs"
RAW_S3 = """
import boto3, os, sys, time
from boto3.s3.transfer import TransferConfig
bucket, dest, threads, part = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) << 20
c = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT"], region_name="us-east-1")
cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=threads)
keys = [o["Key"] for p in c.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in p.get("Contents", [])
        if not o["Key"].endswith(".hsextract-manifest.json")]
for k in keys:
    path = os.path.join(dest, k)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    c.download_file(bucket, k, path, Config=cfg)
print("RAW", sum(os.path.getsize(os.path.join(dest, k)) for k in keys))
"""


class Log:
    def info(self, msg, *args):
        pass

    def warning(self, msg, *args):
        print("warning:", msg % args, flush=True)


def make_sources(src: Path, model_gib: float, data_gib: float, file_mib: int) -> tuple[Path, Path]:
    model, data = src / "model", src / "data"
    model.mkdir(parents=True)
    data.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "num_hidden_layers": 64}))
    n = max(1, round(model_gib * 1024 / file_mib))
    for i in range(n):
        (model / f"model-{i + 1:05d}-of-{n:05d}.safetensors").write_bytes(os.urandom(file_mib << 20))
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    n = max(1, round(data_gib * 1024 / file_mib))
    row = 0
    for i in range(n):
        with open(data / f"train-{i:05d}.jsonl", "w") as f:
            while f.tell() < file_mib << 20:
                text = " ".join(rng.choices(words, k=400))
                f.write(json.dumps({"id": f"r{row}", "messages": [{"role": "user", "content": text[:800]},
                                                                   {"role": "assistant", "content": text[800:]}]})
                        + "\n")
                row += 1
    return model, data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.endswith(".json.tmp"))


def on_all(inventory, fn) -> tuple[float, list]:
    """`fn(host)` on every host at once: the wall time until the last is done, and what each returned."""
    began = time.monotonic()
    with ThreadPoolExecutor(len(inventory.hosts)) as pool:
        def one(spec):
            with connect(spec, inventory) as host:
                return fn(host)
        results = list(pool.map(one, inventory.hosts))
    return time.monotonic() - began, results


def clear(inventory, what: str) -> None:
    for spec in inventory.hosts:
        shutil.rmtree(Path(spec.workdir) / what, ignore_errors=True)


def second_staging(path: str, inventory, resolve, stage) -> str:
    """The table's row for staging the same sources again: the plan's `resolve()` and every host's `stage`."""
    began = time.monotonic()
    sources = resolve()
    _, staged = on_all(inventory, lambda host: stage(host, sources))
    assert all(s.sent_bytes == 0 for s in staged), [s.sent_bytes for s in staged]
    took = time.monotonic() - began
    return f"| {path}, second staging of the same run (plan + every host) | {took:.1f} | 0 sent | | |"


def row(label: str, seconds: float, nbytes: int, raw: float | None = None) -> str:
    rate = nbytes / seconds / 2**20
    ratio = f"{rate / raw:.2f}" if raw else ""
    return f"| {label} | {seconds:.1f} | {nbytes / 2**30:.1f} | {rate:,.0f} | {ratio} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--model-gib", type=float, default=2.0)
    ap.add_argument("--data-gib", type=float, default=1.0)
    ap.add_argument("--file-mib", type=int, default=256)
    ap.add_argument("--part-mib", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--paths", choices=("both", "s3", "orchestrator"), default="both")
    args = ap.parse_args()
    import boto3
    from boto3.s3.transfer import TransferConfig

    work = Path(tempfile.mkdtemp(prefix="hsx-stage-", dir="/var/tmp"))
    lines = ["| path, what | seconds | GiB to all hosts | MiB/s | vs raw |", "|---|---|---|---|---|"]
    port = free_port()
    moto = subprocess.Popen([sys.executable, str(ROOT / "tests" / "harness" / "s3range.py"), str(port)],
                            env={**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 33)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        began = time.monotonic()
        model, data = make_sources(work / "src", args.model_gib, args.data_gib, args.file_mib)
        per_host = size_of(model) + size_of(data)
        print(f"sources: model {size_of(model):,} bytes, dataset {size_of(data):,} bytes "
              f"({time.monotonic() - began:.0f}s to make)", flush=True)
        with SshdFarm() as farm:
            for i in range(args.hosts):
                farm.add_host(f"s{i:02d}", netns=True)
            entries = [ssh_host_entry(farm.host(f"s{i:02d}"), work / f"w-s{i:02d}", gpus=(0,))
                       for i in range(args.hosts)]
            inventory = parse_inventory(write_inventory(work / "hosts.yaml", entries).read_text())
            bundle = build_bundle(ROOT)
            on_all(inventory, lambda host: deploy_host(host, bundle, "0.1.0"))
            endpoint = f"http://{farm.host('s00').gateway or '127.0.0.1'}:{port}"
            access = S3Access(endpoint_url=endpoint, region="us-east-1", access_key_id="testing",
                              secret_access_key="testing")
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                  aws_access_key_id="testing", aws_secret_access_key="testing")
            for _ in range(100):
                try:
                    client.create_bucket(Bucket=BUCKET)
                    break
                except Exception:
                    time.sleep(0.2)
            one_put = TransferConfig(multipart_threshold=(args.file_mib << 20) + 1)
            for root, prefix in ((model, "model"), (data, "data")):
                for p in sorted(root.iterdir()):
                    client.upload_file(str(p), BUCKET, f"{prefix}/{p.name}", Config=one_put)
            total = per_host * args.hosts
            print(f"{args.hosts} hosts; {per_host / 2**30:.2f} GiB per host, {total / 2**30:.1f} GiB in all",
                  flush=True)

            # ---- S3 -> hosts
            if args.paths in ("both", "s3"):
                def raw_s3(host):  # noqa: E306
                    creds = f"{host.spec.workdir}/raw-credentials"
                    host.put(b"[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n", creds, 30)
                    r = host.run(f"AWS_SHARED_CREDENTIALS_FILE={creds} S3_ENDPOINT={endpoint} {host.spec.python} -c "
                                 f"'{RAW_S3}' {BUCKET} {host.spec.workdir}/raw {args.threads} {args.part_mib}", 3600)
                    assert r.ok and f"RAW {per_host}" in r.stdout, r.describe()
                raw_s, _ = on_all(inventory, raw_s3)
                clear(inventory, "raw")
                raw_rate = total / raw_s / 2**20
                lines.append(row("S3, raw copy (boto3 download_file)", raw_s, total))
                print(lines[-1], flush=True)
                params = {"model": f"s3://{BUCKET}/model/", "data": f"s3://{BUCKET}/data/"}
                sources = resolve_sources(params["model"], params["data"], access)
                def stage(host, sources):
                    return stage_host(host, sources, bundle.sha256, access, threads=args.threads,
                                      part_mib=args.part_mib)
                first_s, staged = on_all(inventory, lambda host: stage(host, sources))
                assert all(s.sent_bytes == per_host for s in staged), [s.sent_bytes for s in staged]
                began = time.monotonic()
                _, odd = settle_manifests(sources, {s.host: s for s in staged}, access, Log())
                settle_s = time.monotonic() - began
                assert not odd, odd
                lines.append(row("S3, staged (first: no manifest; digests computed, agreed, manifest written)",
                                 first_s + settle_s, total, raw_rate))
                print(lines[-1], flush=True)
                clear(inventory, "inputs")
                sources = resolve_sources(params["model"], params["data"], access)  # now with the manifest
                again_s, staged = on_all(inventory, lambda host: stage(host, sources))
                assert all(s.sent_bytes == per_host for s in staged)
                lines.append(row("S3, staged (manifest known)", again_s, total, raw_rate))
                print(lines[-1], flush=True)
                lines.append(second_staging("S3", inventory, lambda: resolve_sources(params["model"], params["data"], access), stage))
                print(lines[-1], flush=True)
                clear(inventory, "inputs")

            # ---- orchestrator -> hosts
            if args.paths in ("both", "orchestrator"):
                files = [p for p in sorted(model.iterdir())] + [p for p in sorted(data.iterdir())]

                def raw_sftp(host):
                    host.run(f"mkdir -p {host.spec.workdir}/raw", 30)
                    host.append_files([(p, f"{host.spec.workdir}/raw/{p.parent.name}-{p.name}", 0) for p in files],
                                      3600)
                raw_s, _ = on_all(inventory, raw_sftp)
                clear(inventory, "raw")
                raw_rate = total / raw_s / 2**20
                lines.append(row("orchestrator, raw copy (sftp put, as staging sends)", raw_s, total))
                print(lines[-1], flush=True)

                def scp(spec):
                    os.makedirs(f"{spec.workdir}/raw", exist_ok=True)
                    subprocess.run(["scp", "-q", "-B", "-i", str(spec.key_filename), "-P", str(spec.port),
                                    "-o", f"UserKnownHostsFile={farm.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                                    *map(str, files), f"{spec.user}@{spec.hostname}:{spec.workdir}/raw/"], check=True)
                began = time.monotonic()
                with ThreadPoolExecutor(args.hosts) as pool:
                    list(pool.map(scp, inventory.hosts))
                scp_s = time.monotonic() - began
                clear(inventory, "raw")
                lines.append(row("orchestrator, raw copy (OpenSSH scp)", scp_s, total))
                raw_rate = max(raw_rate, total / scp_s / 2**20)  # the faster of the two is the bar
                print(lines[-1], flush=True)
                began = time.monotonic()
                params = {"model": f"orchestrator:{model}", "data": f"orchestrator:{data}"}
                sources = resolve_sources(params["model"], params["data"], access)
                manifest_s = time.monotonic() - began
                def stage(host, sources):  # noqa: F811
                    return stage_host(host, sources, bundle.sha256, access)
                first_s, staged = on_all(inventory, lambda host: stage(host, sources))
                assert all(s.sent_bytes == per_host for s in staged)
                lines.append(row("orchestrator, staged (SFTP, then verified on the host)", first_s, total, raw_rate))
                lines.append(f"| orchestrator, the manifest made once on the orchestrator (sha256 of the source) | "
                             f"{manifest_s:.1f} | {per_host / 2**30:.1f} | {per_host / manifest_s / 2**20:,.0f} | |")
                print("\n".join(lines[-2:]), flush=True)
                lines.append(second_staging("orchestrator", inventory, lambda: resolve_sources(params["model"], params["data"], access),
                                            stage))
                clear(inventory, "inputs")
    finally:
        moto.terminate()
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
