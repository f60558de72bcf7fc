"""What the Prefect UI shows about a run's shards, and what the next run reads back from it.

- one progress artifact per shard (samples done / total, from the heartbeats);
- a shard status table artifact, republished every `interval_s` and at every state change: host, GPU, pid,
  state, samples, skipped, tokens/s, heartbeat age, files and bytes written and uploaded, failed
  attempts, last error, for every shard of the run (shards a run does not touch keep their last row).
  Its latest version is also the run's attempt record: the next run of the same `run_name` reads the
  failure count and the last failing host of each shard from it (attempt cap, placement away from a
  host that just failed);
- an event on every shard state change, `extract.shard.<state>`, with the shard, host and reason.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field

from prefect import get_run_logger
from prefect.artifacts import Artifact, create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.events import emit_event

EVENT_PREFIX = "extract.shard."
ERROR_CHARS = 400


def run_key(run: str) -> str:
    """`run` as an artifact-key fragment (lowercase letters, digits, dashes); a hash keeps odd names apart."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[:60] or "run"
    return slug if slug == run else f"{slug}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"


def table_key(run: str) -> str:
    return f"shards-{run_key(run)}"


@dataclass
class Row:
    shard: int
    num_shards: int = 0
    host: str = ""
    gpu: int | None = None
    pid: int | None = None
    state: str = "pending"
    samples_done: int = 0
    samples_total: int = 0
    skipped: int = 0
    tokens_per_s: float = 0.0
    heartbeat_age_s: float | None = None
    files: int = 0
    bytes: int = 0
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    failed_attempts: int = 0
    last_failed_host: str = ""
    last_error: str = ""
    progress_id: object = None
    progress_at: float = 0.0
    progress_sent: float = -1.0

    def table(self) -> dict:
        return {"shard": self.shard, "of": self.num_shards, "host": self.host, "gpu": self.gpu, "pid": self.pid, "state": self.state,
                "samples": f"{self.samples_done}/{self.samples_total}", "skipped": self.skipped,
                "tokens_per_s": round(self.tokens_per_s), "heartbeat_age_s":
                    None if self.heartbeat_age_s is None else round(self.heartbeat_age_s, 1),
                "files": self.files, "mb": round(self.bytes / 1e6, 1), "files_uploaded": self.files_uploaded,
                "mb_uploaded": round(self.bytes_uploaded / 1e6, 1), "failed_attempts": self.failed_attempts,
                "last_failed_host": self.last_failed_host, "last_error": self.last_error}


def _one_line(text: str) -> str:
    text = " | ".join(line.strip() for line in str(text).splitlines() if line.strip())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def read_table(run: str, num_shards: int) -> dict[int, dict]:
    """{shard: row} of the latest status table of `run` for `num_shards` shards (empty if there is none).

    Rows of another shard count (the run was re-sharded) are ignored: shard i of N is not shard i of M."""
    artifact = Artifact.get(table_key(run))
    if artifact is None or not artifact.data:
        return {}
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    return {int(r["shard"]): r for r in rows
            if isinstance(r, dict) and "shard" in r and r.get("of", num_shards) == num_shards}


@dataclass
class Board:
    """The run's shard rows; thread-safe; publishes from a background thread carrying the flow's context."""

    run: str
    num_shards: int
    shards: list[int]
    interval_s: float = 15.0
    related: list[dict] = field(default_factory=list)
    prior: dict[int, dict] = field(default_factory=dict)  # read_table(): the run's earlier rows

    def __post_init__(self):
        self.rows = {s: Row(s, self.num_shards) for s in self.shards}
        for shard, seen in self.prior.items():
            if shard in self.rows:  # running again: its counts carry over
                row = self.rows[shard]
                row.failed_attempts = int(seen.get("failed_attempts") or 0)
                row.last_failed_host, row.last_error = seen.get("last_failed_host") or "", seen.get("last_error") or ""
        # shards this run does not touch keep their last row: the table (and the attempt record) stays whole
        self.carried = {s: r for s, r in self.prior.items() if s not in self.rows and 0 <= s < self.num_shards}
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = get_run_logger()

    # --- what the flow tells it -------------------------------------------------------------------------
    def failed_attempts(self, shard: int) -> int:
        return self.rows[shard].failed_attempts

    def last_failed_host(self, shard: int) -> str:
        return self.rows[shard].last_failed_host

    def last_error(self, shard: int) -> str:
        return self.rows[shard].last_error

    def set_state(self, shard: int, state: str, reason: str = "", **payload) -> None:
        """Record a state change, emit `extract.shard.<state>`, and republish the table soon."""
        with self._lock:
            row = self.rows[shard]
            row.state = state
            for name in ("host", "gpu", "pid"):
                if payload.get(name) is not None:
                    setattr(row, name, payload[name])
            if state == "failed":
                row.failed_attempts += 1
                row.last_failed_host, row.last_error = row.host, _one_line(reason)
            snapshot = row.table()
        self._emit(state, snapshot, reason, payload)
        if state in ("done", "complete") and self.rows[shard].progress_id is not None:
            self._progress(self.rows[shard], force=True)
        self._dirty.set()

    def beat(self, shard: int, heartbeat: dict | None, age: float | None) -> None:
        """A probe of a running shard: counters from its heartbeat, and the progress artifact now and then."""
        beat = heartbeat or {}
        with self._lock:
            row = self.rows[shard]
            row.samples_done = int(beat.get("samples_done") or 0)
            row.samples_total = int(beat.get("samples_total") or 0)
            row.skipped = int(beat.get("samples_skipped") or 0)
            row.tokens_per_s = float(beat.get("tokens_per_s") or 0.0)
            row.heartbeat_age_s = age
            row.files, row.bytes = int(beat.get("files") or 0), int(beat.get("bytes") or 0)
            row.files_uploaded = int(beat.get("files_uploaded") or 0)
            row.bytes_uploaded = int(beat.get("bytes_uploaded") or 0)
        self._progress(row)

    # --- publishing -------------------------------------------------------------------------------------
    def _percent(self, row: Row) -> float:
        if row.state in ("done", "complete"):
            return 100.0
        return round(100.0 * row.samples_done / row.samples_total, 1) if row.samples_total else 0.0

    def _progress(self, row: Row, force: bool = False) -> None:
        percent = self._percent(row)
        now = time.monotonic()
        if not force and (percent == row.progress_sent or now - row.progress_at < min(self.interval_s, 5.0)):
            return
        description = f"run {self.run} shard {row.shard}/{self.num_shards} on {row.host or '?'}: " \
                      f"{row.samples_done}/{row.samples_total} samples"
        try:
            if row.progress_id is None:
                row.progress_id = create_progress_artifact(
                    percent, key=f"progress-{run_key(self.run)}-{row.shard:05d}", description=description)
            else:
                update_progress_artifact(row.progress_id, percent, description=description)
            row.progress_at, row.progress_sent = now, percent
        except Exception as exc:  # the UI is a view: a failed update never fails the shard
            self._log.warning("run %s shard %d: progress artifact not updated: %s", self.run, row.shard, exc)

    def publish(self) -> None:
        with self._lock:
            rows = {**self.carried, **{s: r.table() for s, r in self.rows.items()}}
        table = [rows[s] for s in sorted(rows)]
        counts: dict[str, int] = {}
        for r in table:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        try:
            create_table_artifact(table, key=table_key(self.run),
                                  description=f"run {self.run}: shards of {self.num_shards}: {summary}")
        except Exception as exc:
            self._log.warning("run %s: shard status table not published: %s", self.run, exc)

    def _emit(self, state: str, row: dict, reason: str, payload: dict) -> None:
        resource = {"prefect.resource.id": f"hsextract.shard.{run_key(self.run)}.{row['shard']}",
                    "prefect.resource.name": f"{self.run} shard {row['shard']}",
                    "hsextract.run": self.run, "hsextract.shard": str(row["shard"]),
                    "hsextract.host": row["host"] or ""}
        body = {"run_name": self.run, "shard": row["shard"], "num_shards": self.num_shards, "host": row["host"],
                "gpu": row["gpu"], "pid": row["pid"], "reason": reason, "failed_attempts": row["failed_attempts"],
                "samples": row["samples"], **{k: v for k, v in payload.items() if k not in ("host", "gpu", "pid")}}
        try:
            emit_event(f"{EVENT_PREFIX}{state}", resource=resource, related=self.related, payload=body)
        except Exception as exc:
            self._log.warning("run %s shard %s: event %s%s not sent: %s", self.run, row["shard"], EVENT_PREFIX,
                              state, exc)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(self.interval_s)
            self._dirty.clear()
            if self._stop.is_set():
                break
            self.publish()
            time.sleep(0.5)  # coalesce a burst of state changes into one version

    def __enter__(self) -> "Board":
        self.publish()
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,),
                                        name="hsextract-board", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.publish()
