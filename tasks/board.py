"""What the Prefect UI shows about a run's shards: a view, never a record anyone reads back.

- one progress artifact per shard (samples done / total, from the heartbeats);
- a shard status table artifact, republished every `interval_s` and at every state change: host, GPU, pid,
  state, samples, skipped, tokens/s, heartbeat age, files and bytes written and uploaded, and from the
  attempt record (tasks/attempts.py) failed attempts, last failing host and last error, for every shard of
  the run (a shard this run does not touch shows the row the record kept of it);
- an event on every shard state change, `extract.shard.<state>`, with the shard, host and reason.
A state change goes to the attempt record first (a failure counted, how the shard ended), then to the view.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
import threading
import time
from dataclasses import dataclass, field

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.events import emit_event

from .attempts import AttemptRecord

EVENT_PREFIX = "extract.shard."
SETTLED = ("done", "failed", "capped")  # kept in the attempt record (a complete shard: the journals say so)


def run_key(run: str) -> str:
    """`run` as an artifact-key fragment (lowercase letters, digits, dashes); a hash keeps odd names apart."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[:60] or "run"
    return slug if slug == run else f"{slug}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"


def table_key(run: str) -> str:
    """The key of the run's shard table artifact."""
    return f"shards-{run_key(run)}"


@dataclass
class Row:
    """What the table shows of one shard in this run (the attempt columns come from the record)."""

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
    progress_id: object = None
    progress_at: float = 0.0
    progress_sent: float = -1.0

    def table(self) -> dict:
        """The row as the table shows it (without the attempt columns, which come from the record)."""
        return {"shard": self.shard, "of": self.num_shards, "host": self.host, "gpu": self.gpu, "pid": self.pid, "state": self.state,
                "samples": f"{self.samples_done}/{self.samples_total}", "skipped": self.skipped,
                "tokens_per_s": round(self.tokens_per_s), "heartbeat_age_s":
                    None if self.heartbeat_age_s is None else round(self.heartbeat_age_s, 1),
                "files": self.files, "mb": round(self.bytes / 1e6, 1), "files_uploaded": self.files_uploaded,
                "mb_uploaded": round(self.bytes_uploaded / 1e6, 1)}


@dataclass
class Board:
    """The run's shard rows; thread-safe; publishes from a background thread carrying the flow's context."""

    run: str
    num_shards: int
    shards: list[int]
    attempts: AttemptRecord
    interval_s: float = 15.0
    related: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.rows = {s: Row(s, self.num_shards) for s in self.shards}
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = get_run_logger()

    # --- what the flow tells it -------------------------------------------------------------------------
    def set_state(self, shard: int, state: str, reason: str = "", **payload) -> None:
        """A state change: into the attempt record when the run leaves the shard there (a failure counted),
        then the event `extract.shard.<state>`, and the table republished soon."""
        with self._lock:
            row = self.rows[shard]
            row.state = state
            for name in ("host", "gpu", "pid"):
                if payload.get(name) is not None:
                    setattr(row, name, payload[name])
            snapshot = row.table()
        if state == "failed":
            self.attempts.failed(shard, snapshot["host"], reason)
        if state in SETTLED:
            self.attempts.ended(shard, snapshot)
        self._emit(state, self._with_attempts(snapshot), reason, payload)
        if state in ("done", "complete") and self.rows[shard].progress_id is not None:
            self._progress(self.rows[shard], force=True)
        self._dirty.set()

    def _with_attempts(self, row: dict) -> dict:
        seen = self.attempts.get(row["shard"])
        return {**row, "failed_attempts": seen.failed_attempts, "last_failed_host": seen.last_failed_host,
                "last_error": seen.last_error}

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
        """One new version of the table: this run's rows, and the record's last row of every other shard."""
        with self._lock:
            rows = {s: r.table() for s, r in self.rows.items()}
        for shard in self.attempts.known():
            last = self.attempts.get(shard).last
            if shard not in rows and last:
                rows[shard] = last
        table = [self._with_attempts(rows[s]) for s in sorted(rows)]
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
        self.attempts.write()  # what an earlier write could not store
        self.publish()
