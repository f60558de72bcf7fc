"""The attempt record (tasks/attempts.py): durable in the output, counted across runs, never losing a count."""

from __future__ import annotations

import json
import logging
import threading

from hsextract.store import LocalStore
from tasks.attempts import AttemptRecord
from tasks.failures import WHY_CHARS


def test_failures_and_endings_are_written_beside_the_journals_and_read_by_the_next_run(tmp_path):
    store = LocalStore(tmp_path / "out")
    first = AttemptRecord(store, "r1", 4)
    first.failed(2, "gpu-a", "line one\nline two " + "x" * 600)
    first.ended(2, {"shard": 2, "state": "failed", "host": "gpu-a"})
    stored = json.loads((tmp_path / "out" / "_runs" / "r1" / "attempts.json").read_text())
    assert set(stored) == {"shard-00002-of-00004"}
    again = AttemptRecord(store, "r1", 4)
    seen = again.get(2)
    assert seen.failed_attempts == 1 and seen.last_failed_host == "gpu-a" and seen.last["state"] == "failed"
    assert seen.last_error.startswith("line one | line two") and len(seen.last_error) == WHY_CHARS
    assert again.known() == [2] and again.get(0).failed_attempts == 0
    assert AttemptRecord(store, "r1", 8).known() == [], "shard 2 of 4 is not shard 2 of 8"
    assert AttemptRecord(store, "other", 4).known() == [], "one record per run name"
    again.reset([2, 3])
    assert AttemptRecord(store, "r1", 4).get(2).failed_attempts == 0
    assert AttemptRecord(store, "r1", 4).get(2).last_failed_host == "gpu-a", "placement still avoids that host"


def test_two_runs_of_one_run_name_never_lose_each_others_failures(tmp_path):
    store = LocalStore(tmp_path / "out")
    runs = [AttemptRecord(store, "r", 2), AttemptRecord(store, "r", 2)]  # both read an empty record
    threads = [threading.Thread(target=lambda rec=rec: [rec.failed(0, "h", "boom") for _ in range(10)])
               for rec in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert AttemptRecord(store, "r", 2).get(0).failed_attempts == 20


def test_an_output_the_orchestrator_cannot_see_keeps_the_record_in_memory_and_says_so(tmp_path, caplog):
    visible = [False]
    store = LocalStore(tmp_path / "remote-only")
    record = AttemptRecord(store, "r", 1, logging.getLogger("t"), reachable=lambda: visible[0])
    with caplog.at_level(logging.WARNING):
        record.failed(0, "h", "boom")
    assert record.get(0).failed_attempts == 1 and not (tmp_path / "remote-only").exists()
    assert "not visible from the orchestrator" in caplog.text
    visible[0] = True  # the output appeared (a worker made it): what waited goes out with the next change
    record.failed(0, "h", "again")
    assert AttemptRecord(store, "r", 1).get(0).failed_attempts == 2


def test_changes_a_write_could_not_store_go_out_with_the_next_one(tmp_path):
    store = LocalStore(tmp_path / "out")
    blocker = tmp_path / "out" / "_runs" / "r"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the record's directory goes")
    record = AttemptRecord(store, "r", 1)
    record.failed(0, "h", "one")
    assert "not written yet" in record.problem and record.get(0).failed_attempts == 1
    blocker.unlink()
    record.failed(0, "h", "two")
    assert AttemptRecord(store, "r", 1).get(0).failed_attempts == 2
