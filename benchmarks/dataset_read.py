"""Reading a dataset in the worker's formats: rows a second of `iter_records` against pyarrow alone.

    .venv/bin/python benchmarks/dataset_read.py [--rows 1000000]

Builds ROWS chat records (two to six turns of lognormal lengths, an id each) once as JSONL and as Parquet (row
groups of 64K), then times, each over every row:
  - pyarrow alone: `pq.read_table` (columnar, no Python objects), and `iter_batches` + `to_pylist` (the rows as
    Python dicts: what any row-wise reader needs)
  - the worker: `hsextract.data.records.iter_records` over the Parquet file and over the JSONL (rows -> validated
    records with their sample ids); over the Parquet for one shard of 8, as a worker reads it (every row's id,
    its own rows validated); and `iter_ids` over the Parquet (what reconcile reads)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path


def build(rows: int, work: Path) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    words = ["the", "model", "states", "layer", "token", "batch", "shard", "host", "file", "run"]
    jsonl, parquet = work / "d.jsonl", work / "d.parquet"
    writer = None
    with jsonl.open("w") as out:
        for start in range(0, rows, 65536):
            chunk = []
            for i in range(start, min(rows, start + 65536)):
                turns = []
                for t in range(rng.randint(2, 6)):
                    n = min(400, max(3, int(rng.lognormvariate(math.log(40), 0.8))))
                    turns.append({"role": "user" if t % 2 == 0 else "assistant",
                                  "content": " ".join(rng.choice(words) for _ in range(n))})
                chunk.append({"id": f"s{i:08d}", "messages": turns})
            out.write("".join(json.dumps(r) + "\n" for r in chunk))
            table = pa.Table.from_pylist(chunk)
            writer = writer or pq.ParquetWriter(parquet, table.schema)
            writer.write_table(table)
    writer.close()
    return jsonl, parquet


def timed(fn) -> tuple[float, int]:
    began = time.perf_counter()
    n = fn()
    return time.perf_counter() - began, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args()
    import pyarrow.parquet as pq

    from hsextract.data.records import iter_ids, iter_records
    from hsextract.data.assign import shard_of

    work = Path(tempfile.mkdtemp(prefix="hsx-read-"))
    began = time.perf_counter()
    jsonl, parquet = build(args.rows, work)
    print(f"{args.rows:,} rows built in {time.perf_counter() - began:.0f}s: JSONL {jsonl.stat().st_size / 2**20:,.0f} MiB,"
          f" Parquet {parquet.stat().st_size / 2**20:,.0f} MiB", flush=True)
    runs = {
        "pyarrow read_table (columnar, no rows)": lambda: pq.read_table(parquet).num_rows,
        "pyarrow iter_batches + to_pylist (rows as dicts)": lambda: sum(
            len(b.to_pylist()) for b in pq.ParquetFile(parquet).iter_batches(batch_size=1024)),
        "iter_records, Parquet (validated records, ids)": lambda: sum(1 for _ in iter_records(parquet)),
        "iter_records, Parquet, one shard of 8 (a worker's read)": lambda: sum(
            1 for _ in iter_records(parquet, keep=lambda i: shard_of(i, 8) == 0)) and args.rows,
        "iter_ids, Parquet (reconcile's read)": lambda: sum(1 for _ in iter_ids(parquet)),
        "iter_records, JSONL": lambda: sum(1 for _ in iter_records(jsonl)),
    }
    results = {}
    for name, fn in runs.items():
        seconds, n = timed(fn)
        assert n == args.rows, (name, n)
        results[name] = args.rows / seconds
        print(f"{name:<52} {seconds:>7.1f} s {args.rows / seconds:>12,.0f} rows/s", flush=True)
    rows = results["pyarrow iter_batches + to_pylist (rows as dicts)"]
    ours = results["iter_records, Parquet (validated records, ids)"]
    shard = results["iter_records, Parquet, one shard of 8 (a worker's read)"]
    print(f"\nagainst pyarrow's own row reading: iter_records on Parquet {ours / rows:.2f}x, a worker's read (one "
          f"shard of 8) {shard / rows:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
