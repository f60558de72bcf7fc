"""Where a reader's checksum check spends its time: ways of hashing cached batch files, each alone and on
several threads at once (issue 38: the in-process local reader's check cost 80% of its throughput on a 16-core
VM, 24% on 2 cores, while xxh3 of a mapped cached file alone ran at 24 GB/s).

`--files` files of `--mb` MB are written, read once (page cache), then hashed by each way, `--threads` threads
each hashing its own files (aggregate GB/s, best of `--repeats`):
  mmap-copy   the readers' way: a private (copy-on-write) mapping, fadvise WILLNEED, xxh3-128 over it
  mmap-read   a shared read-only mapping, xxh3-128 over it
  populate    a private mapping with MAP_POPULATE (every page mapped by the kernel up front)
  pread       the file read in chunks (`--chunk-mb`) into one reused buffer, xxh3 streamed over them
and the consumer's side: every file's bytes copied out of a fresh mapping into one buffer by torch, on all its
threads (`copy-torch`) and on one (`copy-torch-1`): what a trainer's collate does with a sample's states. Then
the two at once (`together`: half the files copied, the other half hashed: do they share the memory's
bandwidth?), and memory's own speed without files (`in memory`: a torch copy, xxh3 on N threads).

    .venv/bin/python benchmarks/hash_paths.py [--files 8] [--mb 448] [--threads 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
import xxhash

from hsextract.output.batchfile import map_pages


def mmap_copy(path: Path, chunk: int) -> str:
    return xxhash.xxh3_128(map_pages(path).numpy()).hexdigest()


def mmap_read(path: Path, chunk: int) -> str:
    with open(path, "rb") as f:
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return xxhash.xxh3_128(pages).hexdigest()
    finally:
        pages.close()


def populate(path: Path, chunk: int) -> str:
    with open(path, "rb") as f:
        pages = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    try:
        return xxhash.xxh3_128(pages).hexdigest()
    finally:
        pages.close()


_buffers = threading.local()


def pread(path: Path, chunk: int) -> str:
    buffer = getattr(_buffers, "b", None)
    if buffer is None or len(buffer) != chunk:
        buffer = _buffers.b = bytearray(chunk)
    view, digest = memoryview(buffer), xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def copy_torch(path: Path, chunk: int) -> str:
    data = map_pages(path)
    out = getattr(_buffers, "t", None)
    if out is None or out.numel() < data.numel():
        out = _buffers.t = torch.empty(data.numel(), dtype=torch.uint8)
    out[:data.numel()].copy_(data)
    return ""


def together(files: list[Path], threads: int, chunk: int) -> tuple[float, float]:
    """The consumer's copy (torch, all its threads) of half the files beside `threads` threads hashing the other
    half (mapped), started together: (copy GB/s over the copy's time, hash GB/s over the last hashing thread's).
    Is it the memory's bandwidth they share?"""
    half = len(files) // 2
    copied, hashed = files[:half], files[half:]
    ends = {}

    def hashing(mine: list[Path]) -> None:
        for path in mine:
            mmap_read(path, chunk)
        ends["hash"] = max(ends.get("hash", 0.0), time.perf_counter() - began)

    workers = [threading.Thread(target=hashing, args=(hashed[k::threads],)) for k in range(threads)]
    began = time.perf_counter()
    for w in workers:
        w.start()
    for path in copied:
        copy_torch(path, chunk)
    ends["copy"] = time.perf_counter() - began
    for w in workers:
        w.join()
    size = lambda paths: sum(p.stat().st_size for p in paths)  # noqa: E731
    return size(copied) / ends["copy"] / 1e9, size(hashed) / ends["hash"] / 1e9


def in_memory(threads: int, size: int = 2**30) -> tuple[float, float]:
    """Memory's own speed, no file: torch's copy of `size` bytes on all its threads, and xxh3 of `size` bytes on
    each of `threads` threads at once (GB/s)."""
    src, dst = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    dst.copy_(src)
    began = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    copy = 3 * size / (time.perf_counter() - began) / 1e9
    data = src.numpy()
    workers = [threading.Thread(target=lambda: xxhash.xxh3_128(data).hexdigest()) for _ in range(threads)]
    began = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return copy, threads * size / (time.perf_counter() - began) / 1e9


WAYS = {"mmap-copy": mmap_copy, "mmap-read": mmap_read, "populate": populate, "pread": pread,
        "copy-torch": copy_torch, "copy-torch-1": copy_torch}


def run(way: str, files: list[Path], threads: int, chunk: int) -> float:
    """Seconds for `threads` threads to hash every file once, file i on thread i % threads."""
    fn, digests = WAYS[way], {}

    def work(mine: list[Path]) -> None:
        for path in mine:
            digests[path] = fn(path, chunk)

    workers = [threading.Thread(target=work, args=(files[k::threads],)) for k in range(threads)]
    began = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mb", type=int, default=448, help="each file's size (the stream benchmark's: ~447 MB)")
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--chunk-mb", type=float, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS))
    args = parser.parse_args()
    chunk = int(args.chunk_mb * 2**20)
    torch_threads = torch.get_num_threads()
    print(f"{os.cpu_count()} CPU cores, torch threads {torch_threads}, {os.uname().release}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hsx-hash-") as tmp:
        files = []
        block = os.urandom(1 << 20)
        for k in range(args.files):
            path = Path(tmp) / f"f{k}.bin"
            with open(path, "wb") as f:
                for _ in range(args.mb):
                    f.write(block)
            files.append(path)
        total = args.files * args.mb * 2**20
        for path in files:  # into the page cache
            pread(path, chunk)
        want = {p: pread(p, chunk) for p in files}
        rows = []
        for way in args.ways.split(","):
            torch.set_num_threads(1 if way == "copy-torch-1" else torch_threads)
            for threads in (int(t) for t in args.threads.split(",")):
                best = min(run(way, files, threads, chunk) for _ in range(args.repeats))
                if not way.startswith("copy"):
                    assert all(fn == want[p] for p, fn in zip(files, (WAYS[way](p, chunk) for p in files))), way
                row = {"way": way, "threads": threads, "gb_per_s": round(total / best / 1e9, 2),
                       "per_thread_gb_per_s": round(total / best / 1e9 / threads, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        torch.set_num_threads(torch_threads)
        for threads in (int(t) for t in args.threads.split(",")):
            copy, hashed = max((together(files, threads, chunk) for _ in range(args.repeats)), key=sum)
            print(json.dumps({"way": "together", "threads": threads, "copy_gb_per_s": round(copy, 2),
                              "hash_gb_per_s": round(hashed, 2), "sum": round(copy + hashed, 2)}), flush=True)
        for threads in (int(t) for t in args.threads.split(",")):
            copy, hashed = in_memory(threads)
            print(json.dumps({"way": "in memory", "threads": threads, "torch_copy_gb_per_s": round(copy, 2),
                              "hash_gb_per_s": round(hashed, 2)}), flush=True)
    print("\n| way | " + " | ".join(f"{t} thread(s) GB/s" for t in args.threads.split(",")) + " |")
    print("|---|" + "---|" * len(args.threads.split(",")))
    for way in args.ways.split(","):
        print(f"| {way} | " + " | ".join(str(r["gb_per_s"]) for r in rows if r["way"] == way) + " |")


if __name__ == "__main__":
    main()
