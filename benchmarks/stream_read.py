"""HiddenStatesStream against a raw sequential read of the same objects, on a local output and on S3.

A synthetic output of real batch files (bf16 states of `--layers` x `--hidden` per token, by default
dflash:5 of the Qwen3.6-27B shape: 51 KB a token; lognormal sample lengths, `--tokens-per-file` tokens per
file, journals as the worker writes them) is read `--epochs` times each way: raw (every journaled file's bytes,
in journal order: `readinto` one reused buffer locally, `get_object().read()` from S3) and through
`HiddenStatesStream(keys="specforge-dflash")`, which yields each sample as a trainer's record, whose states
the benchmark copies into a preallocated buffer (what a collate or pinning step does): in this process, and
through a DataLoader with `--workers` persistent worker processes. Figures: samples/s, bytes/s, the mean
seconds from an epoch's start to its first sample (the readers' first downloads, which share the bandwidth
with their prefetches: a real epoch of thousands of files hides it, these few files do not), and the
stream's bytes/s over the raw read's (the issue's goal >= 0.9), each with the readers' default checksum check
(xxh3 of every file against its journal) and with it off (`verify=False`: the cost of the check). Locally both read
from the page cache (each is run once to warm it, then measured; with `--cold` also with the files evicted
before each read, so that its first epoch reads the disk); S3 is moto's server, a process of its
own on loopback (`--no-s3` skips it). Then `hsextract export` of the local output to specforge-dflash and
speculators: time, MB/s and peak RSS.

    .venv/bin/python benchmarks/stream_read.py [--files 6] [--hidden 5120] [--layers 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from hsextract.output.batchfile import write_batch
from hsextract.training.stream import HiddenStatesStream


def build(out: Path, files: int, tokens_per_file: int, layers: int, hidden: int) -> tuple[int, int]:
    """Write `files` batch files + a journal into out/shard-00000-of-00001; (samples, state bytes)."""
    shard = out / "shard-00000-of-00001"
    shard.mkdir(parents=True)
    rng, lines, samples, state_bytes = random.Random(0), [], 0, 0
    for seq in range(files):
        lengths, total = [], 0
        while total < tokens_per_file:
            n = min(4096, max(16, int(rng.lognormvariate(6.0, 0.7))))
            lengths.append(n)
            total += n
        ids = [f"s{samples + k:07d}" for k in range(len(lengths))]
        tensors = {"hidden_states": torch.randn(total, layers * hidden).to(torch.bfloat16),
                   "input_ids": torch.randint(0, 1000, (total,), dtype=torch.int32),
                   "loss_mask": torch.ones(total, dtype=torch.uint8),
                   "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)}
        # layers 1..n-1 and the model's last one: every format but EAGLE-3 (no final normed state) can use it
        meta = {"sample_ids": json.dumps(ids), "layer_ids": json.dumps([*range(1, layers), layers + 3]),
                "model": "synthetic", "hidden_size": str(hidden), "num_model_layers": str(layers + 4),
                "dtype": "bfloat16", "hsextract_version": "bench"}
        written = write_batch(shard / f"batch-{seq:06d}.safetensors", tensors, meta)
        lines.append(json.dumps({"kind": "file", "file": written.name, "ids": ids, "tokens": total,
                                 "lengths": lengths, "bytes": written.bytes, "sha256": written.sha256,
                                 "xxh3": written.xxh3, "time": 0}))
        samples += len(ids)
        state_bytes += tensors["hidden_states"].numel() * 2
    lines.append(json.dumps({"kind": "done", "summary": {}, "time": 0}))
    (shard / "journal.jsonl").write_text("\n".join(lines) + "\n")
    return samples, state_bytes


def raw_read(read_one, names: list[str], epochs: int) -> tuple[float, int]:
    began, size = time.perf_counter(), 0
    for _ in range(epochs):
        for name in names:
            size += len(read_one(name))
    return time.perf_counter() - began, size


def stream_read(uri: str, prefetch: int, epochs: int, workers: int = 0,
                verify: bool | str = True) -> tuple[float, float, int, int, list[float]]:
    """Every sample's states copied into one preallocated buffer, as a collate or pinning step does: a
    local output's records are views of its files' pages, and only a copy reads them. `workers`: through a
    DataLoader with that many persistent worker processes, as a training loop over several epochs has
    them. (seconds, mean seconds from an epoch's start to its first sample, samples, state bytes, each epoch's
    seconds: the first checks every file, a later one only the files that changed)."""
    began, starts, samples, size, each = time.perf_counter(), [], 0, 0, []
    buffer = torch.empty(0, dtype=torch.bfloat16)
    stream = HiddenStatesStream(uri, keys="specforge-dflash", prefetch=prefetch, verify=verify)
    source = (torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=True)
              if workers else stream)
    for epoch in range(epochs):
        stream.set_epoch(epoch)
        start, first = time.perf_counter(), None
        for sample in source:
            states = sample["hidden_states"].reshape(-1)
            if buffer.numel() < states.numel():
                buffer = torch.empty(states.numel(), dtype=states.dtype)
            buffer[:states.numel()].copy_(states)
            samples += 1
            size += states.numel() * states.element_size()
            first = first or time.perf_counter() - start
        starts.append(first)
        each.append(time.perf_counter() - start)
    return time.perf_counter() - began, sum(starts) / len(starts), samples, size, each


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (posix_fadvise DONTNEED): the next read comes from the disk."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(label: str, uri: str, read_one, names: list[str], file_bytes: int, prefetch: int, epochs: int,
            workers: int = 0, verify: bool | str = True, cold: list[Path] | None = None) -> dict:
    """`cold`: these files are evicted before each measured read (so each first epoch reads the disk), and
    nothing is read to warm them."""
    if cold is None:
        raw_read(read_one, names, 1)  # warm (page cache / server)
        stream_read(uri, prefetch, 1, workers, verify)  # another stream: the one measured checks its files anew
    else:
        evict(cold)
    raw_s, got = raw_read(read_one, names, epochs)
    assert got == file_bytes * epochs, (got, file_bytes)
    if cold is not None:
        evict(cold)
    stream_s, first_s, samples, state, each = stream_read(uri, prefetch, epochs, workers, verify)
    label += f", {workers} DataLoader workers" if workers else ""
    label += {False: ", checksums off", True: "", "full": ", sha256"}[verify]
    label += ", first epoch from the disk" if cold is not None else ""
    row = {"where": label, "files": len(names), "file_mb": round(file_bytes / 1e6, 1), "epochs": epochs,
           "raw_s": round(raw_s, 2), "raw_mb_per_s": round(got / raw_s / 1e6),
           "stream_s": round(stream_s, 2), "epoch_start_s": round(first_s, 3),
           "samples_per_s": round(samples / stream_s), "stream_mb_per_s": round(got / stream_s / 1e6),
           "state_mb_per_s": round(state / stream_s / 1e6), "ratio": round(raw_s / stream_s, 3),
           "first_epoch_mb_per_s": round(file_bytes / each[0] / 1e6),
           "later_epochs_mb_per_s": round(file_bytes * (epochs - 1) / sum(each[1:]) / 1e6) if epochs > 1 else None}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--tokens-per-file", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="reads of the whole output, each way")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="also read through a DataLoader with N workers (0: not)")
    parser.add_argument("--cold", action="store_true",
                        help="also the local reads with the files evicted from the page cache first (a first epoch "
                             "from the disk, as a training run on a fresh host reads it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hsx-stream-") as tmp:
        out = Path(tmp) / "out"
        samples, state = build(out, args.files, args.tokens_per_file, args.layers, args.hidden)
        shard = out / "shard-00000-of-00001"
        names = sorted(p.name for p in shard.glob("batch-*.safetensors"))
        file_bytes = sum((shard / n).stat().st_size for n in names)
        print(f"{args.files} files, {samples} samples, {file_bytes / 1e6:.0f} MB ({state / 1e6:.0f} MB of states: "
              f"{args.layers} layers x {args.hidden} bf16 per token), prefetch {args.prefetch}, "
              f"{os.cpu_count()} CPU cores", flush=True)
        buffer = bytearray(max((shard / n).stat().st_size for n in names))

        def read_local(name: str) -> memoryview:  # into one reused buffer: the cheapest raw read there is
            with open(shard / name, "rb", buffering=0) as f:
                return memoryview(buffer)[:f.readinto(buffer)]

        rows = [measure("local", str(out), read_local, names, file_bytes, args.prefetch, args.epochs, n, v)
                for n in sorted({0, args.workers}) for v in (False, True)]
        if args.cold:
            paths = [shard / n for n in names]
            rows += [measure("local", str(out), read_local, names, file_bytes, args.prefetch, args.epochs, n, v,
                             cold=paths) for n in sorted({0, args.workers}) for v in (False, True)]
        if not args.no_s3:
            rows += s3_rows(out, names, file_bytes, args.prefetch, args.epochs, args.workers)
        exports = [export_row(out, Path(tmp) / fmt, fmt, file_bytes) for fmt in ("specforge-dflash", "speculators")]
    print("\n| export | samples | s | MB/s | peak RSS MB |\n|---|---|---|---|---|")
    for r in exports:
        print(f"| {r['format']} | {r['exported']} | {r['s']} | {r['mb_per_s']} | {r['peak_rss_mb']} |")
    print("\n| where | files x epochs | MB | raw MB/s | stream samples/s | stream MB/s | first epoch MB/s | "
          "later epochs MB/s | epoch start s | stream / raw |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['where']} | {r['files']} x {r['epochs']} | {r['file_mb']} | {r['raw_mb_per_s']} | "
              f"{r['samples_per_s']} | {r['stream_mb_per_s']} | {r['first_epoch_mb_per_s']} | "
              f"{r['later_epochs_mb_per_s']} | {r['epoch_start_s']} | {r['ratio']} |")


def export_row(out: Path, dest: Path, fmt: str, file_bytes: int) -> dict:
    """`hsextract export` of the local output as a process of its own: wall time and its peak RSS."""
    import subprocess
    import sys

    began, peak_kb = time.perf_counter(), 0
    child = subprocess.Popen([sys.executable, "-m", "hsextract", "export", str(out), str(dest), "--format", fmt],
                             stdout=subprocess.DEVNULL)
    while child.poll() is None:  # VmHWM: the process's own peak (wait4's ru_maxrss counts this one's too, from
        try:                     # before the exec)
            status = Path(f"/proc/{child.pid}/status").read_text()
            peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
        except (OSError, IndexError):
            pass
        time.sleep(0.05)
    seconds = time.perf_counter() - began
    assert child.returncode == 0, f"export {fmt} failed ({child.returncode})"
    summary = json.loads((dest / "export.json").read_text())
    row = {"format": fmt, "exported": summary["exported"], "s": round(seconds, 1),
           "mb_per_s": round(file_bytes / seconds / 1e6), "peak_rss_mb": round(peak_kb / 1024)}
    print(json.dumps(row), flush=True)
    return row


def s3_rows(out: Path, names: list[str], file_bytes: int, prefetch: int, epochs: int, workers: int) -> list[dict]:
    """The same objects on moto's S3 server, run as a process of its own (as S3 is: not sharing this GIL)."""
    import base64
    import subprocess
    import sys

    import boto3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    serve = ("import sys, threading\nfrom moto.server import ThreadedMotoServer\n"
             "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False); s.start()\n"
             "print('%s %d' % s.get_host_and_port(), flush=True); sys.stdin.read()")
    server = subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        host, port = server.stdout.readline().split()
        os.environ["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        shard = out / "shard-00000-of-00001"
        for path in sorted(shard.iterdir()):
            body = path.read_bytes()
            client.put_object(Bucket="bench", Key=f"run/{shard.name}/{path.name}", Body=body,
                              ChecksumSHA256=base64.b64encode(hashlib.sha256(body).digest()).decode())
        key = f"run/{shard.name}/"

        def get(name: str) -> bytes:
            return client.get_object(Bucket="bench", Key=key + name)["Body"].read()

        return [measure("s3 (moto, loopback)", "s3://bench/run", get, names, file_bytes, prefetch, epochs, n, v)
                for n in sorted({0, workers}) for v in (False, True)]
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
