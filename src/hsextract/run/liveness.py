"""The liveness contract: `STARTED` line, heartbeat file kept fresh, exit status left on exit.

Files in the status directory (default: the shard's directory under a local output):
  heartbeat.json  {"time", "pid", "shard", "num_shards", "phase", "samples_done", "samples_total",
                   "samples_skipped", "tokens_done", "tokens_per_s", "files", "bytes", "last_batch",
                   "spool_bytes", "upload_memory_bytes", "files_uploaded", "bytes_uploaded", "startup", ...}
                  ("startup": seconds from the process start to each phase and milestone reached so far)
  exit.json       {"time", "pid", "code", "reason"} (+ "stop": "cancelled" | "stopped" when the signal that
                  ended it came with a stop request)
  stop.json       written by the orchestrator before it signals a worker to stop on purpose:
                  {"stop": "cancelled" | "stopped", "why": "...", "time"}; the worker names it in exit.json
Both are replaced atomically (temp file + rename), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hsextract.store import write_atomic

HEARTBEAT_NAME = "heartbeat.json"
EXIT_NAME = "exit.json"
STOP_NAME = "stop.json"
STOP_KINDS = ("cancelled", "stopped")  # the run was cancelled / this shard was stopped on purpose


def stop_request(status_dir: Path) -> dict | None:
    """The orchestrator's stop request in `status_dir` ({"stop", "why", ...}), None when there is none."""
    try:
        request = json.loads((Path(status_dir) / STOP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return request if isinstance(request, dict) and request.get("stop") in STOP_KINDS else None


def process_started_at() -> float:
    """When this process started (epoch seconds; from /proc, in 10 ms ticks), so that start-up figures include
    the interpreter's own start; where /proc says nothing, the time this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # after the command name
        ticks = int(fields[19])  # field 22, starttime: clock ticks from boot to this process's start
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return IMPORTED_AT
    return time.time() - max(0.0, age)


IMPORTED_AT = time.time()
PROCESS_START = min(IMPORTED_AT, process_started_at())
if IMPORTED_AT - PROCESS_START > 600:  # a /proc whose clocks disagree (no worker imports this that late)
    PROCESS_START = IMPORTED_AT


def announce_start(shard: int, num_shards: int, version: str) -> None:
    """Print the `STARTED` line and flush: the first proof of life, before anything heavy is imported."""
    print(f"STARTED shard={shard}/{num_shards} pid={os.getpid()} version={version}", flush=True)


def write_json_atomic(path: Path, payload: dict) -> None:
    """`payload` as compact JSON at `path`, replaced atomically (a reader never sees half a file)."""
    write_atomic(path, json.dumps(payload, separators=(",", ":")).encode())


@dataclass
class Progress:
    """Counters the worker updates and the heartbeat publishes (plain ints: updates are atomic enough)."""

    shard: int
    num_shards: int
    version: str
    phase: str = "starting"
    samples_total: int = 0
    samples_done: int = 0
    samples_skipped: int = 0
    samples_written: int = 0  # by this process (samples_done also counts what earlier runs finished)
    tokens_done: int = 0
    files: int = 0
    bytes: int = 0
    forward_passes: int = 0
    padded_tokens: int = 0      # longest x count, summed over forward passes
    tokens_forwarded: int = 0   # real tokens in those passes
    last_batch: str | None = None
    spool_bytes: int = 0        # written, waiting for upload (s3:// output)
    upload_memory_bytes: int = 0  # held in memory, waiting for upload (--upload-from memory)
    upload_paused: bool = False  # extraction waits for uploads (spool over its high-water mark)
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    confined: bool = False      # writes restricted to this shard's directories (Landlock)
    started_at: float = field(default_factory=time.time)
    extract_started_at: float | None = None
    startup: dict = field(default_factory=dict)  # milestone -> seconds from the process start (first reached)
    layer_rms: list | None = None  # per captured layer, the RMS of the states stored so far (a layer drifting off)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name == "phase" and "startup" in self.__dict__:  # every phase entered is a milestone
            self.mark(value)

    def mark(self, milestone: str) -> None:
        """Note the first time `milestone` is reached, in seconds from the process start. A new dict each time:
        the heartbeat's thread may be reading the old one."""
        if milestone not in self.startup:
            self.startup = {**self.startup, milestone: round(time.time() - PROCESS_START, 3)}

    def describe_startup(self) -> str:
        """The milestones so far, in order: "importing 0.0s, reading_data 2.9s, ..." (from the process start)."""
        return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.startup.items())

    def tokens_per_s(self) -> float:
        """Tokens written per second since extraction started."""
        if self.extract_started_at is None:
            return 0.0
        elapsed = time.time() - self.extract_started_at
        return self.tokens_done / elapsed if elapsed > 0 else 0.0

    def snapshot(self) -> dict:
        """The heartbeat's JSON body: every counter, the time, the pid, the rate."""
        data = asdict(self)
        data.update(time=round(time.time(), 3), pid=os.getpid(), tokens_per_s=round(self.tokens_per_s(), 1))
        return data


class Heartbeat:
    """Background thread rewriting heartbeat.json every `interval_s` until stopped."""

    def __init__(self, status_dir: Path, progress: Progress, interval_s: float = 2.0):
        self.path = status_dir / HEARTBEAT_NAME
        self.exit_path = status_dir / EXIT_NAME
        self.progress = progress
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hsextract-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Remove an earlier exit status, write the first heartbeat, start beating."""
        self.exit_path.unlink(missing_ok=True)  # a previous run's status must not be read as ours
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        """Write heartbeat.json now (a failed write is printed, never raised: extraction goes on)."""
        try:
            write_json_atomic(self.path, self.progress.snapshot())
        except OSError as exc:  # a full disk must not kill extraction; the stale heartbeat will say it
            print(f"hsextract: heartbeat write failed: {exc}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def finish(self, code: int, reason: str, **extra) -> None:
        """Stop beating, write a last heartbeat and the exit status (if the status directory exists); `extra`
        goes into exit.json too."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1)
        if not self.path.parent.is_dir():
            return  # arguments failed before it could be made: stderr and the exit code carry the reason
        self.progress.phase = "done" if code == 0 else "failed"
        self.beat()
        status = {"time": round(time.time(), 3), "pid": os.getpid(), "code": code, "reason": reason, **extra}
        try:
            write_json_atomic(self.exit_path, status)
        except OSError as exc:
            print(f"hsextract: cannot write {self.exit_path}: {exc}", file=sys.stderr, flush=True)
