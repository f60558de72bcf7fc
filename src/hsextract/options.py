"""Every option of `hsextract extract`, its default and its help, in one place: `WorkerOptions`.

The CLI's parser is built from it (`add_arguments`), the orchestrator builds the launch's argument list with
`argv()` and takes the flow parameters' defaults from its class attributes (`WorkerOptions.token_budget`).
`check()` validates what needs no file system; `prepare_dirs()` makes and proves the directories. Every
problem is a `UsageError` naming the option. No torch here: the orchestrator imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast, get_args

from hsextract.errors import UsageError
from hsextract.output.journal import shard_dir_name
from hsextract.store import local_dir

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
OutDtype = Literal["auto", "fp8_e4m3"]
Overlong = Literal["skip", "truncate"]
UploadFrom = Literal["disk", "memory"]
Kernels = Literal["default", "fused"]
ConfineMode = Literal["auto", "on", "off"]
DTYPES, OUT_DTYPES, OVERLONG_POLICIES = get_args(Dtype), get_args(OutDtype), get_args(Overlong)
#: `hsextract export --format` (the export contract; hsextract.training.export writes them)
EXPORT_FORMATS = ("specforge-dflash", "specforge-eagle3", "speculators")
UPLOAD_FROM, KERNEL_CHOICES = get_args(UploadFrom), get_args(Kernels)
DEFAULT_KERNELS: Kernels = "default"  # what transformers computes, to the bit
CONFINE_MODES = get_args(ConfineMode)
PROGRESS_MODES = ("auto", "bar", "log")


def prove_writable(label: str, path: Path) -> None:
    """Make the directory `path` and write a file in it (UsageError naming the option `label` when it cannot)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        raise UsageError(f"{label} {str(path)!r}: not writable ({exc.strerror or exc})") from None


def option(text: str, *, required: bool = False, choices: tuple[str, ...] | None = None, metavar: str | None = None):
    """The CLI side of a field: its help text, whether the CLI requires it, argparse choices."""
    return {"help": text, "required": required, "choices": choices, "metavar": metavar}


@dataclass(frozen=True)
class WorkerOptions:
    """The arguments of one shard's worker. Field `token_budget` is the CLI's `--token-budget`."""

    # model, data, out and layers: None only until given (required=True: the CLI refuses a command without them)
    model: Path = field(default=cast(Path, None), metadata=option(
        "local model directory (config, weights, tokenizer)", required=True))
    data: Path = field(default=cast(Path, None), metadata=option(
        "dataset: JSONL (plain, .gz, .zst), a Parquet file or directory, or a `datasets` save_to_disk directory",
        required=True))
    out: str = field(default=cast(str, None), metadata=option(
        "output: a directory, file:// URI or s3://bucket/prefix", required=True))
    layers: str = field(default=cast(str, None), metadata=option(
        "dflash:N, eagle3, or a list like 1,16,31; SPEC+last adds the last decoder layer", required=True))
    shard: int = field(default=0, metadata=option("this shard's index, 0..num-shards-1", required=True))
    num_shards: int = field(default=1, metadata=option("how many shards the dataset is split into", required=True))
    max_length: int | None = field(default=None, metadata=option(
        "longest sample in tokens (default: the model's own limit, max_position_embeddings; see --overlong)"))
    overlong: Overlong = field(default="skip", metadata=option(
        "samples over --max-length: skip them (default, journaled as too_long) or keep their first tokens "
        "(truncate)", choices=OVERLONG_POLICIES))
    token_budget: int = field(default=8192, metadata=option("padded tokens per batch (one file per batch)"))
    sort_window: int = field(default=1024, metadata=option("samples sorted by length together"))
    device: str = field(default="auto", metadata=option("cpu, cuda or cuda:N (default: cuda if available)"))
    dtype: Dtype = field(default="auto", metadata=option(
        "auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32"))
    out_dtype: OutDtype = field(default="auto", metadata=option(
        "stored states: auto (the model's dtype, lossless) or fp8_e4m3 (half of bf16, lossy: a scale per token "
        "and layer; the reader returns bf16)", choices=OUT_DTYPES))
    include_last: bool = field(default=False, metadata=option("also store the final normed hidden state"))
    kernels: Kernels = field(default=DEFAULT_KERNELS, metadata=option(
        "the decoder's GPU kernels: default (the states transformers computes, to the bit) or fused (RMSNorm, "
        "gated RMSNorm and SwiGLU fused, gate and up one matrix product: +21%% at 64 layers of Qwen3.6-27B's "
        "shape on an H100; rounds differently, fp32 inside: the output's recipe records it); CUDA only",
        choices=KERNEL_CHOICES))
    random_weights: int | None = field(default=None, metadata=option(
        "build the model from --model's config.json with random weights (this seed, made on the device) instead "
        "of loading its weights: for benchmarks and for checking a host before the weights arrive; the states "
        "are of no real model (their files say so)", metavar="SEED"))
    synthetic: float | None = field(default=None, metadata=option(
        "no model: write random states of the real per-token size (the model's hidden size x the layers) at "
        "this many tokens a second, through the same journal, liveness and upload path, importing no torch "
        "(fleet simulations, preflights); chat records count one token per 4 characters (their files say "
        "synthetic)", metavar="TOKENS_PER_S"))
    tune_procs: int | None = field(default=None, metadata=option(
        "on CUDA, child processes that tune the GPU kernels for every batch size while the model loads "
        "(default 0: none, the worker tunes them on a thread beside the load; on an H100 8 of them did not "
        "start an untuned host sooner)", metavar="N"))
    read_ahead_gb: float | None = field(default=None, metadata=option(
        "read the checkpoint's weights into the page cache from the process start, while torch and CUDA start, "
        "up to this many GB (default: what the load needs, at most half the host's available memory; 0: off, "
        "and no preload: the weights are read by transformers after the imports)",
        metavar="GB"))
    load_after_imports: bool = field(default=False, metadata=option(
        "read the weights only once transformers and the model's code are imported, from the files, by "
        "transformers (default: on a thread beside those imports, straight into the device's memory)"))
    warm_after_load: bool = field(default=False, metadata=option(
        "on CUDA, tune and warm the GPU kernels for every batch size only after the model's load (default: on a "
        "thread beside the load, on one module of each kind built from the config with random weights)"))
    status_dir: Path | None = field(default=None, metadata=option("heartbeat/exit files (default: shard dir)"))
    heartbeat_interval: float = field(default=2.0, metadata=option("seconds between heartbeats"))
    log_interval: float = field(default=30.0, metadata=option("seconds between log lines (no terminal)"))
    progress: str = field(default="auto", metadata=option("a progress bar on a terminal, else log lines",
                                                          choices=PROGRESS_MODES))
    spool: Path | None = field(default=None, metadata=option(
        "with --out s3://...: local directory for files waiting to upload (default: <status dir>/spool, "
        "else ./hsextract-spool)"))
    spool_high_gb: float = field(default=64.0, metadata=option("pause extraction above this much waiting"))
    spool_low_gb: float = field(default=32.0, metadata=option("resume it below this"))
    s3_endpoint: str | None = field(default=None, metadata=option(
        "S3-compatible endpoint URL (default: AWS / $AWS_ENDPOINT_URL)"))
    upload_part_mb: int = field(default=64, metadata=option("multipart part size"))
    upload_from: UploadFrom = field(default="disk", metadata=option(
        "with --out s3://...: upload each file after writing it to the spool (default), or straight from "
        "memory, writing to the spool only when --upload-memory-gb is full", choices=UPLOAD_FROM))
    upload_memory_gb: float = field(default=8.0, metadata=option(
        "--upload-from memory: most bytes held in memory waiting for upload"))
    hash_threads: int = field(default=0, metadata=option(
        "batch files hashed (sha256) at once; 0: one per four cores, at most 3"))
    confine: ConfineMode = field(default="auto", metadata=option(
        "restrict this process's writes to its own shard's directories with Linux Landlock: auto (when the "
        "kernel has it, default), on (fail without it), off", choices=CONFINE_MODES))
    max_skipped: float = field(default=0.01, metadata=option(
        "the shard fails (exit 2, not retried) when more than this share of its samples is skipped, or when it "
        "stores none of them: its reasons are named with a count and an example line each (1 allows any)",
        metavar="FRACTION"))
    retry_skipped: str = field(default="", metadata=option(
        "comma-separated skip reasons to try again (e.g. oom,nonfinite_states)", metavar="REASONS"))
    aws_credentials_file: Path | None = field(default=None, metadata=option(
        "a shared-credentials file for S3 that this worker reads and removes when it exits (the orchestrator "
        "writes it, mode 0600, for the life of one shard)"))

    # --- the command line ------------------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One `--flag` per field, with its default, help and choices."""
        for f in dataclasses.fields(cls):
            meta, flag = f.metadata, "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=meta["help"])
                continue
            kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(f.type, str)
            if f.type in ("Path", "Path | None"):
                kind = Path
            parser.add_argument(flag, type=kind, required=meta["required"], help=meta["help"],
                                choices=meta["choices"], metavar=meta["metavar"],
                                default=None if meta["required"] else f.default)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerOptions:
        """The options argparse parsed (`add_arguments`'s flags)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def argv(self) -> list[str]:
        """The command-line arguments that give these options: the required ones, then every other option
        that differs from its default, in field order."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.metadata["required"] and value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                out.append(flag)
            else:
                out += [flag, repr(value) if isinstance(value, float) else str(value)]
        return out

    # --- what the options mean -------------------------------------------------------------------------------
    @property
    def upload(self) -> str | None:
        """The `s3://` URI the files go to, when the output is in S3 (they are written to the spool first)."""
        return self.out if local_dir(self.out) is None else None

    @property
    def out_dir(self) -> Path:
        """Where this worker writes batch files and journals: the output itself, or the spool for S3."""
        local = local_dir(self.out)
        if local is None:
            return self.spool or (self.status_dir / "spool" if self.status_dir else Path("hsextract-spool"))
        return local

    @property
    def shard_dir(self) -> Path:
        """This shard's directory under `out_dir`: its batch files and journal."""
        return self.out_dir / shard_dir_name(self.shard, self.num_shards)

    @property
    def status_path(self) -> Path:
        """Where heartbeat.json and exit.json go: --status-dir, else the shard dir."""
        return self.status_dir or self.shard_dir

    @property
    def retry_reasons(self) -> frozenset[str]:
        """The skip reasons --retry-skipped names."""
        return frozenset(r for r in self.retry_skipped.split(",") if r)

    @property
    def spool_high_bytes(self) -> int:
        """--spool-high-gb in bytes."""
        return int(self.spool_high_gb * 2**30)

    @property
    def spool_low_bytes(self) -> int:
        """--spool-low-gb in bytes."""
        return int(self.spool_low_gb * 2**30)

    @property
    def upload_memory_bytes(self) -> int:
        """--upload-memory-gb in bytes."""
        return int(self.upload_memory_gb * 2**30)

    @property
    def upload_part_bytes(self) -> int:
        """--upload-part-mb in bytes."""
        return self.upload_part_mb << 20

    # --- validation -------------------------------------------------------------------------------------------
    def check_out(self) -> None:
        """The output is a local path, file:// or s3:// (what `out_dir` and `upload` can read)."""
        try:
            local_dir(self.out)
        except ValueError:
            raise UsageError(f"--out {self.out!r}: use a local path, file://... or s3://bucket/prefix") from None

    def check(self) -> None:
        """Checks that need nothing but the options themselves (the orchestrator can run them before a launch)."""
        self.check_out()
        if self.num_shards < 1:
            raise UsageError(f"--num-shards {self.num_shards}: must be at least 1")
        if not 0 <= self.shard < self.num_shards:
            raise UsageError(f"--shard {self.shard}: must be in 0..{self.num_shards - 1} for --num-shards "
                             f"{self.num_shards}")
        for name, value in (("--token-budget", self.token_budget), ("--sort-window", self.sort_window)):
            if value < 1:
                raise UsageError(f"{name} {value}: must be a positive integer")
        if self.max_length is not None and self.max_length < 2:
            raise UsageError(f"--max-length {self.max_length}: must be at least 2")
        for name, choice, allowed in (("--overlong", self.overlong, OVERLONG_POLICIES), ("--dtype", self.dtype, DTYPES),
                                      ("--out-dtype", self.out_dtype, OUT_DTYPES),
                                      ("--upload-from", self.upload_from, UPLOAD_FROM),
                                      ("--confine", self.confine, CONFINE_MODES),
                                      ("--kernels", self.kernels, KERNEL_CHOICES)):
            if choice not in allowed:
                raise UsageError(f"{name} {choice!r}: choose one of {allowed}")
        if self.upload is not None and not self.upload[5:].split("/")[0]:
            raise UsageError(f"--out {self.upload!r}: expected s3://bucket/prefix")
        if not 0 < self.spool_low_bytes <= self.spool_high_bytes:
            raise UsageError(f"--spool-low-gb/--spool-high-gb: need 0 < low <= high "
                             f"(got {self.spool_low_gb:g} and {self.spool_high_gb:g})")
        if self.upload_from == "memory" and self.upload is None:
            raise UsageError("--upload-from memory: only with --out s3://bucket/prefix (a local output is the disk)")
        if not 0 <= self.max_skipped <= 1:
            raise UsageError(f"--max-skipped {self.max_skipped:g}: a share of the shard's samples, from 0 to 1")
        if self.hash_threads < 0:
            raise UsageError(f"--hash-threads {self.hash_threads}: must be 0 (auto) or more")
        if self.synthetic is not None and not self.synthetic > 0:
            raise UsageError(f"--synthetic {self.synthetic:g}: must be a positive number of tokens a second")
        if self.synthetic is not None and self.random_weights is not None:
            raise UsageError("--synthetic and --random-weights: choose one (--synthetic runs no model at all)")
        if self.tune_procs is not None and self.tune_procs < 0:
            raise UsageError(f"--tune-procs {self.tune_procs}: must be 0 (none) or more")
        if self.read_ahead_gb is not None and not self.read_ahead_gb >= 0:
            raise UsageError(f"--read-ahead-gb {self.read_ahead_gb:g}: must be 0 (off) or more")
        if self.upload_memory_bytes <= 0:
            raise UsageError(f"--upload-memory-gb {self.upload_memory_gb:g}: must be positive")
        if self.upload_part_bytes < 5 << 20:
            raise UsageError(f"--upload-part-mb {self.upload_part_mb}: S3 parts are at least 5 MB")

    def check_inputs(self) -> None:
        """`check()`, then that the dataset exists (the model is checked when its config is read)."""
        self.check()
        from hsextract.data.inputs import dataset_files

        dataset_files(self.data)  # a file or directory of a format inputs.py reads, else UsageError naming it

    def prepare_dirs(self) -> None:
        """Create the shard and status directories and prove they are writable."""
        for label, path in (("--out", self.shard_dir), ("--status-dir", self.status_path)):
            prove_writable(label, path)
        os.chmod(self.shard_dir, 0o750)
