"""What the recipe costs a worker's start: `recipe_of` (config, tokenizer and template hashed, the weights'
digest from strided pieces of every file) on a checkpoint of the real size.

    .venv/bin/python benchmarks/recipe_cost.py [--gb 54] [--files 12] [--dense-mb 0]

The checkpoint is made of `--files` safetensors files totalling `--gb` GB: a real header each, then sparse
space (the file system stores no data for it: this machine's disk need not hold 54 GB), with `--dense-mb` of
real random bytes written at the offsets the digest reads (so those reads hit a disk and not a hole, when
the page cache is dropped: run as root with --drop-caches). Prints the seconds of `recipe_of`, cold and warm,
and the bytes it read.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from argparse import Namespace
from pathlib import Path

from hsextract import tiny
from hsextract.output.recipe import PIECE_BYTES, PIECES, recipe_of


def build(model: Path, gb: float, files: int) -> int:
    tiny.build_tokenizer(model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "num_hidden_layers": 64,
                                                   "hidden_size": 5120, "vocab_size": 248320}))
    size = int(gb * 1e9 / files)
    read = 0
    for i in range(files):
        header = json.dumps({"__metadata__": {"format": "pt"}, f"w{i}": {"dtype": "BF16", "shape": [size // 2 - 512],
                                                                          "data_offsets": [0, size - 1024]}}).encode()
        header += b" " * (-len(header) % 8)
        path = model / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with path.open("wb") as f:
            for k in range(PIECES):  # real bytes where the digest reads
                f.seek(size * k // PIECES)
                f.write(os.urandom(PIECE_BYTES))
            f.seek(0)
            f.write(len(header).to_bytes(8, "little") + header)  # the header over the first piece's start
            f.truncate(size)
        read += 8 + len(header) + (PIECES + 1) * PIECE_BYTES
    return read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=54.0)
    ap.add_argument("--files", type=int, default=12)
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before the cold run (root)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hsx-recipe-") as tmp:
        model = Path(tmp) / "model"
        read = build(model, args.gb, args.files)
        opts = Namespace(model=model, synthetic=None, random_weights=None, include_last=False, out_dtype="auto",
                         max_length=None, overlong="skip", kernels="default")
        for run in ("cold", "warm"):
            if run == "cold" and args.drop_caches:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            began = time.perf_counter()
            recipe = recipe_of(opts, [1, 16, 31, 46, 61], "bfloat16")
            print(f"recipe_of, {run}: {time.perf_counter() - began:.3f} s over {args.files} files of "
                  f"{args.gb / args.files:.1f} GB ({args.gb:g} GB), reading {read / 2**20:.1f} MiB; "
                  f"fingerprint {recipe.fingerprint}", flush=True)


if __name__ == "__main__":
    main()
