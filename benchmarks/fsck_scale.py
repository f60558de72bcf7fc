"""`hsextract fsck` on an output of 10,000 batch files: a clean pass, `--verify` (every file's checksum), and a
repair of a few planted problems (a file gone, one truncated, a torn journal line, strays).

    .venv/bin/python benchmarks/fsck_scale.py [--files 10000] [--shards 64] [--file-kb 64]

The files are real batch files (`write_batch`: a header with its data checksum) of `--file-kb` KB each, so
`--verify` reads and hashes every byte; the journals are the worker's own format (one `file` entry per file).
Prints seconds for each pass and the problems each found.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hsextract.output.batchfile import write_batch
from hsextract.output.fsck import fsck


def build(out: Path, files: int, shards: int, file_kb: int) -> None:
    states = torch.randn(file_kb * 1024 // (2 * 64), 64).to(torch.bfloat16)  # one batch's bytes, reused
    per_shard = -(-files // shards)
    made = 0
    for shard in range(shards):
        shard_dir = out / f"shard-{shard:05d}-of-{shards:05d}"
        shard_dir.mkdir(parents=True)
        lines = []
        for seq in range(min(per_shard, files - made)):
            ids = [f"s{shard}-{seq}-{k}" for k in range(4)]
            tokens = states.shape[0]
            tensors = {"hidden_states": states, "input_ids": torch.zeros(tokens, dtype=torch.int32),
                       "loss_mask": torch.ones(tokens, dtype=torch.uint8),
                       "cu_seqlens": torch.tensor([0, tokens // 4, tokens // 2, 3 * tokens // 4, tokens])}
            written = write_batch(shard_dir / f"batch-{seq + 1:06d}.safetensors", tensors,
                                  {"sample_ids": json.dumps(ids), "layer_ids": "[1]", "model": "bench",
                                   "hidden_size": "64", "num_model_layers": "4", "dtype": "bfloat16"})
            lines.append(json.dumps({"kind": "file", "file": written.name, "ids": ids, "tokens": tokens,
                                     "bytes": written.bytes, "sha256": written.sha256, "xxh3": written.xxh3,
                                     "time": 0}, separators=(",", ":")))
            made += 1
        lines.append(json.dumps({"kind": "done", "summary": {}, "time": 0}))
        (shard_dir / "journal.jsonl").write_text("\n".join(lines) + "\n")


def timed(label: str, out: Path, **kw) -> dict:
    began = time.perf_counter()
    found = fsck(str(out), **kw)
    seconds = time.perf_counter() - began
    print(f"{label:<34} {seconds:7.2f} s  {len(found['problems'])} problem(s), {len(found['repaired'])} repair(s)",
          flush=True)
    return {"label": label, "seconds": round(seconds, 2), "problems": found["problems"],
            "repaired": found["repaired"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--file-kb", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hsx-fsck-") as tmp:
        out = Path(tmp) / "out"
        began = time.perf_counter()
        build(out, args.files, args.shards, args.file_kb)
        total = sum(p.stat().st_size for p in out.rglob("batch-*.safetensors"))
        print(f"{args.files} batch files ({total / 1e9:.2f} GB) in {args.shards} shards, built in "
              f"{time.perf_counter() - began:.0f}s", flush=True)
        rows = [timed("clean, sizes", out), timed("clean, --verify (every checksum)", out, verify=True)]
        shard = out / f"shard-00001-of-{args.shards:05d}"
        (shard / "batch-000001.safetensors").unlink()
        victim = shard / "batch-000002.safetensors"
        victim.write_bytes(victim.read_bytes()[:100])
        journal = shard / "journal.jsonl"
        lines = journal.read_text().splitlines(keepends=True)
        lines[3] = lines[3][:30] + "\n"
        journal.write_text("".join(lines))
        (shard / ".batch-999999.safetensors.tmp").write_bytes(b"x")
        rows += [timed("4 problems planted, found", out), timed("--repair", out, repair=True),
                 timed("after the repair", out)]
        for row in rows[2:3]:
            for problem in row["problems"]:
                print("   ", problem)
    print("\n| pass | s |\n|---|---|")
    for row in rows:
        print(f"| {row['label']} | {row['seconds']} |")


if __name__ == "__main__":
    main()
