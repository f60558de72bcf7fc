"""`hsextract` command line (the CLI contract). Prints `STARTED` before importing anything heavy."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsextract", description="Extract hidden states for drafter training.")
    parser.add_argument("--version", action="version", version=f"hsextract {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("extract", help="run one shard of an extraction")
    ex.add_argument("--model", required=True, type=Path, help="local model directory (config, weights, tokenizer)")
    ex.add_argument("--data", required=True, type=Path, help="JSONL dataset")
    ex.add_argument("--out", required=True, help="output directory or file:// URI")
    ex.add_argument("--layers", required=True, help="dflash:N, eagle3, or a list like 1,16,31")
    ex.add_argument("--shard", required=True, type=int)
    ex.add_argument("--num-shards", required=True, type=int)
    ex.add_argument("--max-length", type=int, default=None, help="longest sample in tokens (see --overlong)")
    ex.add_argument("--overlong", choices=("truncate", "skip"), default="truncate",
                    help="samples over --max-length: keep the first tokens (default) or skip them")
    ex.add_argument("--token-budget", type=int, default=8192, help="padded tokens per batch (one file per batch)")
    ex.add_argument("--sort-window", type=int, default=1024, help="samples sorted by length together")
    ex.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if available)")
    ex.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32")
    ex.add_argument("--out-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                    help="stored states: auto (the model's dtype, lossless) or fp8_e4m3 (half of bf16, lossy: "
                         "a scale per token and layer; the reader returns bf16)")
    ex.add_argument("--include-last", action="store_true", help="also store the final normed hidden state")
    ex.add_argument("--status-dir", type=Path, default=None, help="heartbeat/exit files (default: shard dir)")
    ex.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds between heartbeats")
    ex.add_argument("--log-interval", type=float, default=30.0, help="seconds between log lines (no terminal)")
    ex.add_argument("--progress", choices=("auto", "bar", "log"), default="auto")
    ex.add_argument("--spool", type=Path, default=None,
                    help="with --out s3://...: local directory for files waiting to upload (default: "
                         "<status dir>/spool, else ./hsextract-spool)")
    ex.add_argument("--spool-high-gb", type=float, default=64.0, help="pause extraction above this much waiting")
    ex.add_argument("--spool-low-gb", type=float, default=32.0, help="resume it below this")
    ex.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL (default: AWS / $AWS_ENDPOINT_URL)")
    ex.add_argument("--upload-part-mb", type=int, default=64, help="multipart part size")
    ex.add_argument("--upload-from", choices=("disk", "memory"), default="disk",
                    help="with --out s3://...: upload each file after writing it to the spool (default), or "
                         "straight from memory, writing to the spool only when --upload-memory-gb is full")
    ex.add_argument("--upload-memory-gb", type=float, default=8.0,
                    help="--upload-from memory: most bytes held in memory waiting for upload")
    ex.add_argument("--hash-threads", type=int, default=0,
                    help="batch files hashed (sha256) at once; 0: one per four cores, at most 3")
    ex.add_argument("--confine", choices=("auto", "on", "off"), default="auto",
                    help="restrict this process's writes to its own shard's directories with Linux Landlock: "
                         "auto (when the kernel has it, default), on (fail without it), off")
    ex.add_argument("--retry-skipped", default="", metavar="REASONS",
                    help="comma-separated skip reasons to try again (e.g. oom,nonfinite_states)")

    inspect = sub.add_parser("inspect", help="count and verify what an output (directory or s3://) holds")
    inspect.add_argument("out", help="output directory, file:// or s3:// URI")
    inspect.add_argument("--verify", action="store_true", help="check every file's sha256 against the journal")

    tiny = sub.add_parser("make-tiny", help="build a tiny random Qwen3.5 hybrid model and a chat dataset")
    tiny.add_argument("--model", type=Path, required=True, help="directory to save the model and tokenizer in")
    tiny.add_argument("--data", type=Path, required=True, help="JSONL file to write")
    tiny.add_argument("--samples", type=int, default=200)
    return parser


def out_path(text: str) -> Path | None:
    """A local output directory from a path or file:// URI; None for schemes this worker cannot write."""
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    return None if "://" in text else Path(text)


def forget_credentials(status_dir: Path) -> None:
    """A credentials file the orchestrator put in this shard's status dir lives only as long as the shard."""
    named = os.environ.get("AWS_SHARED_CREDENTIALS_FILE")
    if named and Path(named).parent.resolve() == status_dir.resolve():
        Path(named).unlink(missing_ok=True)


def confine_shard(cfg, mode: str):
    """Landlock: this shard writes beneath its own directories only (see hsextract.confine). Its output dir
    (with s3://, its spool) and status dir are made first; the dirs that hold the other shards' are never
    writable: the output root, and the parent of the status dir when the orchestrator gave one."""
    from .confine import confine

    own = [cfg.out if cfg.upload else cfg.shard_dir, cfg.status_path]
    with contextlib.suppress(OSError):  # one that cannot be made is reported by the checks that follow
        own[0].mkdir(parents=True, exist_ok=True)
    holds = ([] if cfg.upload else [cfg.out]) + ([cfg.status_path.parent] if cfg.status_dir else [])
    return confine(own, holds, mode)


def main(argv: list[str] | None = None, *, capture=None) -> int:
    """`hsextract` with `argv` (default: the process's); returns the exit code. `capture`: see `run_shard`."""
    args = build_parser().parse_args(argv)
    if args.command == "extract":
        from .liveness import announce_start

        announce_start(args.shard, args.num_shards, __version__)
        from .config import ExtractConfig
        from .liveness import Heartbeat, Progress

        upload = args.out if args.out.startswith("s3://") else None
        out = out_path(args.out) if upload is None else (
            args.spool or (args.status_dir / "spool" if args.status_dir else Path("hsextract-spool")))
        if out is None:
            print(f"hsextract: --out {args.out!r}: use a local path, file://... or s3://bucket/prefix",
                  file=sys.stderr)
            return 2
        cfg = ExtractConfig(
            model=args.model, data=args.data, out=out, layers=args.layers, shard=args.shard,
            num_shards=args.num_shards, max_length=args.max_length, overlong=args.overlong,
            token_budget=args.token_budget, sort_window=args.sort_window, device=args.device, dtype=args.dtype, out_dtype=args.out_dtype,
            include_last=args.include_last, status_dir=args.status_dir,
            heartbeat_interval=args.heartbeat_interval, log_interval=args.log_interval, progress=args.progress,
            retry_skipped=frozenset(r for r in args.retry_skipped.split(",") if r),
            upload=upload, s3_endpoint=args.s3_endpoint, spool_high_bytes=int(args.spool_high_gb * 2**30),
            spool_low_bytes=int(args.spool_low_gb * 2**30), upload_part_bytes=args.upload_part_mb << 20,
            upload_from=args.upload_from, upload_memory_bytes=int(args.upload_memory_gb * 2**30),
            hash_threads=args.hash_threads,
        )
        heartbeat = Heartbeat(cfg.status_path, Progress(args.shard, args.num_shards, __version__),
                              args.heartbeat_interval)
        try:
            cfg.status_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            label = "--status-dir" if cfg.status_dir else "--out"
            print(f"hsextract: {label} {str(cfg.status_path)!r}: not writable ({exc.strerror or exc})",
                  file=sys.stderr)
            return 2
        try:
            confined = confine_shard(cfg, args.confine)  # before any thread starts: they inherit it
        except OSError as exc:
            print(f"hsextract: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"hsextract: shard {cfg.shard}/{cfg.num_shards}: {confined.describe()}", file=sys.stderr, flush=True)
        heartbeat.progress.confined = confined.active
        heartbeat.progress.phase = "importing"
        heartbeat.start()  # the first heartbeat comes before torch is imported
        from .extract import run_shard  # imports torch

        try:
            return run_shard(cfg, heartbeat, **({"capture": capture} if capture else {}))
        finally:
            forget_credentials(cfg.status_path)
    if args.command == "inspect":
        from .reader import describe_output

        print(json.dumps(describe_output(args.out, args.verify)))
        return 0
    from . import tiny as tiny_assets

    if not (args.model / "config.json").exists():
        tiny_assets.build_model(args.model, kind="qwen3_5_text")
    if not args.data.exists():
        tiny_assets.build_dataset(args.data, args.samples)
    print(json.dumps({"model": str(args.model), "data": str(args.data)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
