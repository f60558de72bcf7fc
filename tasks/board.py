"""What the Prefect UI shows about a run: a view, never a record anyone reads back.

- `status-<run>`, the run-level status a person reads first (markdown, tasks/runstatus.py): whole-run
  progress (samples and tokens done / total, rate, ETA), shards by state, and each failed shard's reason;
- `shards-<run>`, the shard table: state, samples, host, GPU, failed attempts, the last error (short) and
  the last failing host (when any shard failed), tokens/s, heartbeat age, files and MB written (and
  uploaded, with an s3:// output), for every shard of the run (a shard this run does not touch shows the
  row the attempt record kept of it);
- one progress artifact per shard (samples done / total, from the heartbeats);
- an event on every shard state change, `extract.shard.<state>`, whose resource name says shard, host, state
  and the reason or samples (what the event feed shows), with the run's flow run, flow and deployment related.

Each artifact is created once per flow run and then updated in place (at state changes, and every
`interval_s` while shards run): a run of hours keeps one card of each, and a re-run adds one version.
A state change goes to the attempt record first (a failure counted, how the shard ended), then to the view.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import cast
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.events import emit_event

from hsextract.errors import Retry

from .attempts import AttemptRecord
from .failures import one_line
from .runstatus import RunProgress, render, totals

EVENT_PREFIX = "extract.shard."
SETTLED = ("done", "failed", "capped")  # kept in the attempt record (a complete shard: the journals say so)
CELL_CHARS = 100  # the table's error cells; the failure-<run> artifact has the whole story


#: most shard progress artifacts created or updated per second, all shards together
PROGRESS_UPDATES_PER_S = 4.0


def run_key(run: str) -> str:
    """`run` as an artifact-key fragment (lowercase letters, digits, dashes); a hash keeps odd names apart."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[:60] or "run"
    return slug if slug == run else f"{slug}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"


def table_key(run: str) -> str:
    """The key of the run's shard table artifact."""
    return f"shards-{run_key(run)}"


def status_key(run: str) -> str:
    """The key of the run's status artifact (whole-run progress, the first thing to read)."""
    return f"status-{run_key(run)}"


@dataclass
class Row:
    """What the view shows of one shard in this run (the attempt columns come from the record)."""

    shard: int
    num_shards: int = 0
    host: str = ""
    gpu: int | None = None
    pid: int | None = None
    state: str = "pending"
    samples_done: int = 0
    samples_total: int = 0
    skipped: int = 0
    tokens_done: int = 0
    tokens_per_s: float = 0.0
    heartbeat_age_s: float | None = None
    files: int = 0
    bytes: int = 0
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    layer_rms: list | None = None  # per captured layer, the RMS of the states stored so far (from the heartbeat)
    progress_id: UUID | None = None
    progress_at: float = 0.0
    progress_sent: float = -1.0

    def table(self) -> dict:
        """The row's own cells, in the order the table shows them (the attempt columns are added after
        `gpu`); the upload columns are dropped later for an output that has no uploads."""
        return {"shard": self.shard, "state": self.state,
                "samples": f"{self.samples_done}/{self.samples_total}" if self.samples_total else "-",
                "host": self.host, "gpu": self.gpu, "tokens_per_s": round(self.tokens_per_s),
                "heartbeat_age_s": None if self.heartbeat_age_s is None else round(self.heartbeat_age_s, 1),
                "files": self.files, "mb": round(self.bytes / 1e6, 1), "files_uploaded": self.files_uploaded,
                "mb_uploaded": round(self.bytes_uploaded / 1e6, 1),
                "layer_rms": " ".join("-" if r is None else f"{r:.3g}" for r in self.layer_rms or ()) or "-"}

    def counts(self) -> dict:
        """What the run's totals add up."""
        return {"state": self.state, "samples_done": self.samples_done, "samples_total": self.samples_total,
                "skipped": self.skipped, "tokens_done": self.tokens_done}


UPLOAD_COLUMNS = ("files_uploaded", "mb_uploaded")
ATTEMPT_COLUMNS = ("failed_attempts", "last_error", "last_failed_host")


@dataclass
class Board:
    """The run's shard rows; thread-safe; publishes from a background thread carrying the flow's context.
    `uploads`: the output is s3:// (the table shows what was uploaded); `links`: label -> where, shown at
    the foot of the status."""

    run: str
    num_shards: int
    shards: list[int]
    attempts: AttemptRecord
    interval_s: float = 15.0
    related: list[dict] = field(default_factory=list)
    uploads: bool = False

    def __post_init__(self) -> None:
        self.rows = {s: Row(s, self.num_shards) for s in self.shards}
        self.progress = RunProgress()
        self.verdict = ""
        self.links: dict[str, str] = {}
        self.hosts_failed: dict[str, str] = {}
        self._artifacts: dict[str, UUID] = {}  # key -> id of this flow run's version
        self._sent: dict[str, tuple] = {}        # key -> what it holds now
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = get_run_logger()
        # progress artifact updates, all shards together: a token bucket of PROGRESS_UPDATES_PER_S (the API's
        # load stays bounded at 256 shards; a shard refused now goes at one of its next readings)
        self._tokens, self._refilled = float(PROGRESS_UPDATES_PER_S), time.monotonic()
        self.progress_updates = 0  # progress artifacts created or updated so far

    # --- what the flow tells it -------------------------------------------------------------------------
    def set_state(self, shard: int, state: str, reason: str = "", retry: Retry = Retry.LATER, **payload) -> None:
        """A state change: into the attempt record when the run leaves the shard there (a failure counted,
        unless a re-run cannot help: `retry` NEVER), then the event `extract.shard.<state>`, and the
        view updated soon."""
        with self._lock:
            row = self.rows[shard]
            row.state = state
            for name in ("host", "gpu", "pid"):
                if payload.get(name) is not None:
                    setattr(row, name, payload[name])
            if state == "done" and payload.get("samples_done") is not None:
                row.samples_done = max(row.samples_done, int(payload["samples_done"]))
                row.samples_total = row.samples_total or row.samples_done
            snapshot, pid = row.table(), row.pid
        if state == "failed":
            self.attempts.failed(shard, snapshot["host"], reason, count=retry is not Retry.NEVER)
        if state in SETTLED:
            self.attempts.ended(shard, snapshot)
        self._emit(state, self._with_attempts(snapshot), reason, {**payload, "pid": pid})
        if state in ("done", "complete") and self.rows[shard].progress_id is not None:
            self._progress(self.rows[shard], force=True)
        self._dirty.set()

    def _with_attempts(self, row: dict) -> dict:
        seen = self.attempts.get(row["shard"])
        shown = {}
        for name, value in row.items():
            if name in ("of", "num_shards") or (name in UPLOAD_COLUMNS and not self.uploads):
                continue
            shown[name] = value
            if name == "gpu":
                shown.update(failed_attempts=seen.failed_attempts, last_error=one_line(seen.last_error, CELL_CHARS),
                             last_failed_host=seen.last_failed_host)
        return shown

    def beat(self, shard: int, heartbeat: dict | None, age: float | None) -> None:
        """A probe of a running shard: counters from its heartbeat, and the progress artifact now and then."""
        beat = heartbeat or {}
        with self._lock:
            row = self.rows[shard]
            row.samples_done = int(beat.get("samples_done") or 0)
            row.samples_total = int(beat.get("samples_total") or 0)
            row.skipped = int(beat.get("samples_skipped") or 0)
            row.tokens_done = int(beat.get("tokens_done") or 0)
            row.tokens_per_s = float(beat.get("tokens_per_s") or 0.0)
            row.heartbeat_age_s = age
            row.files, row.bytes = int(beat.get("files") or 0), int(beat.get("bytes") or 0)
            row.files_uploaded = int(beat.get("files_uploaded") or 0)
            row.bytes_uploaded = int(beat.get("bytes_uploaded") or 0)
            row.layer_rms = beat.get("layer_rms") if isinstance(beat.get("layer_rms"), list) else row.layer_rms
        self._progress(row)

    def host_failed(self, host: str, why: str) -> None:
        """`host` is out of this run (its deploy or preflight check failed, `why`): the status says so."""
        with self._lock:
            self.hosts_failed[host] = why
        self._dirty.set()

    def finish(self, verdict: str, links: dict[str, str] | None = None) -> None:
        """The run's verdict (`complete`, `failed`) and where to read more, into the status (after the board
        closed: the last update of the view)."""
        self.verdict = verdict
        self.links.update(links or {})
        self.publish()

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
        with self._lock:
            self._tokens = min(PROGRESS_UPDATES_PER_S, self._tokens + (now - self._refilled) * PROGRESS_UPDATES_PER_S)
            self._refilled = now
            if not force and self._tokens < 1:
                return
            self._tokens -= 1
        description = f"run {self.run} shard {row.shard}/{self.num_shards} on {row.host or '?'}: " \
                      f"{row.samples_done}/{row.samples_total} samples"
        try:
            if row.progress_id is None:
                row.progress_id = cast(UUID, create_progress_artifact(  # sync here: the id, not a coroutine
                    percent, key=f"progress-{run_key(self.run)}-{row.shard:05d}", description=description))
            else:
                update_progress_artifact(row.progress_id, percent, description=description)
            row.progress_at, row.progress_sent = now, percent
            self.progress_updates += 1
        except Exception as exc:  # the UI is a view: a failed update never fails the shard
            self._log.warning("run %s shard %d: progress artifact not updated: %s", self.run, row.shard, exc)

    def table(self) -> list[dict]:
        """The shard table: this run's rows, and the record's last row of every other shard."""
        with self._lock:
            rows = {s: r.table() for s, r in self.rows.items()}
        for shard in self.attempts.known():
            last = self.attempts.get(shard).last
            if shard not in rows and last:
                rows[shard] = last
        table = [self._with_attempts(rows[s]) for s in sorted(rows)]
        if not any(r["failed_attempts"] or r["last_error"] for r in table):  # nothing failed: no empty columns
            table = [{k: v for k, v in r.items() if k not in ATTEMPT_COLUMNS} for r in table]
        return table

    def status(self) -> str:
        """The markdown of the run's status (whole-run progress first)."""
        with self._lock:
            counts = [r.counts() for r in self.rows.values()]
            failed = [(f"shard {r.shard}/{self.num_shards}" + (f" on {r.host}" if r.host else ""), r.shard)
                      for r in self.rows.values() if r.state in ("failed", "capped")]
            hosts = [(f"host {host}", why) for host, why in sorted(self.hosts_failed.items())]
        now = totals(counts)
        self.progress.add(now)
        reasons = hosts + [(where, one_line(self.attempts.get(shard).last_error, CELL_CHARS) or "?")
                           for where, shard in failed]
        links = {"shard table": f"artifact `{table_key(self.run)}`", **self.links}
        return render(self.run, self.num_shards, now, self.progress, reasons, self.verdict, links)

    def publish(self) -> None:
        """The status and the shard table, created for this flow run or updated in place."""
        table = self.table()
        states: dict[str, int] = {}
        for r in table:
            states[r["state"]] = states.get(r["state"], 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        status = self.status()
        self._put(status_key(self.run), "markdown", status, status.split("\n", 1)[0].lstrip("# ").replace("`", ""))
        self._put(table_key(self.run), "table", table, f"run {self.run}: {self.num_shards} shard(s): {summary}")

    def _put(self, key: str, kind: str, data, description: str) -> None:
        if self._sent.get(key) == (data, description):
            return  # unchanged: no update (each is an event in the feed and in `prefect deployment run --watch`)
        try:
            if key in self._artifacts:
                from prefect.client.orchestration import get_client
                from prefect.client.schemas.actions import ArtifactUpdate

                with get_client(sync_client=True) as client:
                    client.update_artifact(self._artifacts[key], ArtifactUpdate(
                        data=json.dumps(data) if kind == "table" else data, description=description))
            else:
                create = create_table_artifact if kind == "table" else create_markdown_artifact
                self._artifacts[key] = cast(UUID, create(data, key=key, description=description))  # sync: the id
            self._sent[key] = (data, description)
        except Exception as exc:  # the UI is a view: a failed update never fails the run
            self._log.warning("run %s: artifact %s not published: %s", self.run, key, exc)

    def _emit(self, state: str, row: dict, reason: str, payload: dict) -> None:
        facts = one_line(reason, 120) if state in ("failed", "capped") else \
            (f"{row['samples']} samples" if row["samples"] != "-" else one_line(reason, 120))
        resource = {"prefect.resource.id": f"hsextract.run.shard.{run_key(self.run)}.{row['shard']}",
                    "prefect.resource.name": f"{self.run} shard {row['shard']}/{self.num_shards}"
                                             + (f" on {row['host']}" if row["host"] else "") + f": {state}"
                                             + (f", {facts}" if facts else ""),
                    "hsextract.run": self.run, "hsextract.run.shard": str(row["shard"]),
                    "hsextract.host": row["host"] or "", "hsextract.state": state,
                    "hsextract.samples": row["samples"], "hsextract.reason": one_line(reason, 200)}
        body = {"run_name": self.run, "shard": row["shard"], "num_shards": self.num_shards, "host": row["host"],
                "gpu": row["gpu"], "pid": payload.get("pid"), "reason": reason,
                "failed_attempts": self.attempts.get(row["shard"]).failed_attempts,
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
            time.sleep(0.5)  # coalesce a burst of state changes into one update

    def __enter__(self) -> Board:
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
            if self._thread.is_alive():
                self._log.warning("run %s: the status board's update thread did not end within 30s (an update to the "
                                  "Prefect API hanging?): the final update is sent without it", self.run)
        self.attempts.write()  # what an earlier write could not store
        self.publish()
