"""The worker's configuration, validated at the edge: every problem is a `UsageError` naming it."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .chat import OVERLONG_POLICIES
from .errors import UsageError
from .journal import shard_dir_name
from .quant import OUT_DTYPES

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class ExtractConfig:
    model: Path
    data: Path
    out: Path
    layers: str
    shard: int
    num_shards: int
    max_length: int | None = None
    overlong: str = "truncate"
    token_budget: int = 8192
    sort_window: int = 1024
    device: str = "auto"
    dtype: str = "auto"
    out_dtype: str = "auto"  # auto: the model's dtype; fp8_e4m3: e4m3 + a scale per token and layer
    include_last: bool = False
    status_dir: Path | None = None
    heartbeat_interval: float = 2.0
    log_interval: float = 30.0
    progress: str = "auto"  # auto | bar | log
    retry_skipped: frozenset[str] = frozenset()  # skip reasons to try again (e.g. oom on a bigger GPU)
    upload: str | None = None          # s3://bucket/prefix: `out` is then the local spool
    s3_endpoint: str | None = None     # S3-compatible endpoint (default: AWS, or $AWS_ENDPOINT_URL)
    spool_high_bytes: int = 64 << 30   # extraction pauses when this much waits for upload...
    spool_low_bytes: int = 32 << 30    # ...and resumes below this
    upload_part_bytes: int = 64 << 20
    upload_from: str = "disk"          # memory: straight from memory to S3, disk only when over the budget
    upload_memory_bytes: int = 8 << 30  # --upload-from memory: bytes held in memory waiting for upload
    hash_threads: int = 0              # files hashed at once; 0: one per four cores, at most 3

    @property
    def shard_dir(self) -> Path:
        return self.out / shard_dir_name(self.shard, self.num_shards)

    @property
    def status_path(self) -> Path:
        return self.status_dir or self.shard_dir

    def check_arguments(self) -> None:
        """Checks that need nothing but the arguments (cheap; run before the STARTED line's follow-ups)."""
        if self.num_shards < 1:
            raise UsageError(f"--num-shards {self.num_shards}: must be at least 1")
        if not 0 <= self.shard < self.num_shards:
            raise UsageError(f"--shard {self.shard}: must be in 0..{self.num_shards - 1} for --num-shards {self.num_shards}")
        for name, value in (("--token-budget", self.token_budget), ("--sort-window", self.sort_window)):
            if value < 1:
                raise UsageError(f"{name} {value}: must be a positive integer")
        if self.max_length is not None and self.max_length < 2:
            raise UsageError(f"--max-length {self.max_length}: must be at least 2")
        if self.overlong not in OVERLONG_POLICIES:
            raise UsageError(f"--overlong {self.overlong!r}: choose one of {OVERLONG_POLICIES}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype!r}: choose one of {DTYPES}")
        if self.out_dtype not in OUT_DTYPES:
            raise UsageError(f"--out-dtype {self.out_dtype!r}: choose one of {OUT_DTYPES}")
        if self.upload is not None and not (self.upload.startswith("s3://") and self.upload[5:].split("/")[0]):
            raise UsageError(f"--out {self.upload!r}: expected s3://bucket/prefix")
        if not 0 < self.spool_low_bytes <= self.spool_high_bytes:
            raise UsageError(f"--spool-low-gb/--spool-high-gb: need 0 < low <= high "
                             f"(got {self.spool_low_bytes / 2**30:g} and {self.spool_high_bytes / 2**30:g})")
        if self.upload_from not in ("disk", "memory"):
            raise UsageError(f"--upload-from {self.upload_from!r}: choose disk or memory")
        if self.upload_from == "memory" and self.upload is None:
            raise UsageError("--upload-from memory: only with --out s3://bucket/prefix (a local output is the disk)")
        if self.hash_threads < 0:
            raise UsageError(f"--hash-threads {self.hash_threads}: must be 0 (auto) or more")
        if self.upload_memory_bytes <= 0:
            raise UsageError(f"--upload-memory-gb {self.upload_memory_bytes / 2**30:g}: must be positive")
        if self.upload_part_bytes < 5 << 20:
            raise UsageError(f"--upload-part-mb {self.upload_part_bytes >> 20}: S3 parts are at least 5 MB")
        if not self.data.is_file():
            raise UsageError(f"--data {str(self.data)!r}: no such file")

    def prepare_dirs(self) -> None:
        """Create the shard and status directories and prove they are writable."""
        for label, path in (("--out", self.shard_dir), ("--status-dir", self.status_path)):
            try:
                path.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
                    pass
            except OSError as exc:
                raise UsageError(f"{label} {str(path)!r}: not writable ({exc.strerror or exc})") from None
        os.chmod(self.shard_dir, 0o750)
