"""Reconcile time for a synthetic run of 1,000,000 samples in 10,000 objects (goal: under 30 s here).

    .venv/bin/python benchmarks/reconcile_scale.py [--samples 1000000] [--objects 10000] [--shards 64]

Builds a real file:// output: a JSONL dataset with ids, 64 shard journals, and 10,000 small stand-in batch
files whose sizes match their journal entries (the contents are not read unless --verify; at 50-200 TB the
reconcile relies on the store's sizes and checksums, not on re-reading the data). Then times `scan` (what a
run's planning reads) and `reconcile_output` end to end: listing, journals, dataset ids, accounting, index and
_SUCCESS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from hsextract.data.assign import shard_of
from hsextract.store import LocalStore
from hsextract.output.journal import scan
from tasks.reconcile import INDEX_NAME, dataset_ids, reconcile_output


def build(root: Path, samples: int, objects: int, shards: int) -> Path:
    data = root / "data.jsonl"
    ids = [f"conv-{i:08d}" for i in range(samples)]
    with data.open("w") as handle:
        for sample_id in ids:
            handle.write(json.dumps({"id": sample_id, "messages": [{"role": "user", "content": "hi"},
                                                                   {"role": "assistant", "content": "hello"}]}) + "\n")
    by_shard: dict[int, list[str]] = {}
    for sample_id in ids:
        by_shard.setdefault(shard_of(sample_id, shards), []).append(sample_id)
    per_file = max(1, samples // objects)
    rng = random.Random(0)
    out = root / "out"
    for shard, members in by_shard.items():
        shard_dir = out / f"shard-{shard:05d}-of-{shards:05d}"
        shard_dir.mkdir(parents=True)
        lines = []
        for seq, start in enumerate(range(0, len(members), per_file)):
            chunk = members[start:start + per_file]
            name = f"batch-{seq:06d}.safetensors"
            size = rng.randint(1000, 4000)
            (shard_dir / name).write_bytes(b"\0" * size)
            lengths = [rng.randint(100, 4000) for _ in chunk]
            lines.append(json.dumps({"kind": "file", "file": name, "ids": chunk, "tokens": sum(lengths),
                                     "lengths": lengths, "bytes": size, "sha256": "0" * 64, "time": 0},
                                    separators=(",", ":")))
        lines.append(json.dumps({"kind": "done", "summary": {}, "time": 0}))
        (shard_dir / "journal.jsonl").write_text("\n".join(lines) + "\n")
    return data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--objects", type=int, default=10_000)
    ap.add_argument("--shards", type=int, default=64)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hsx-reconcile-"))
    t = time.monotonic()
    data = build(root, args.samples, args.objects, args.shards)
    built = time.monotonic() - t
    n_files = sum(1 for p in (root / "out").rglob("*.safetensors"))
    t = time.monotonic()
    state = scan(LocalStore(root / "out"))  # what a run's planning (and a worker's resume) reads
    scanned = time.monotonic() - t
    assert len(state.done_shards) == args.shards and len(state.written) == args.samples
    t = time.monotonic()
    report = reconcile_output(LocalStore(root / "out"), dataset_ids(data), args.shards)
    seconds = time.monotonic() - t
    assert report.complete and report.sealed and report.done == args.samples, report.summary()
    index_mb = (root / "out" / INDEX_NAME).stat().st_size / 1e6
    print(f"built {args.samples:,} samples in {n_files:,} objects over {args.shards} shards in {built:.1f}s "
          f"({os.cpu_count()} CPU cores)")
    print(f"scan (list, every journal parsed and merged: what planning and a worker's resume read): {scanned:.2f} s")
    print(f"reconcile (list, journals, dataset ids, accounting, index {index_mb:.0f} MB, _SUCCESS): "
          f"{seconds:.2f} s   goal < 30 s")


if __name__ == "__main__":
    main()
