"""Liveness contract: STARTED line, a heartbeat that keeps moving, exit.json on exit, atomic writes."""

from __future__ import annotations

import json
import os
import time

import pytest

from hsextract.run.liveness import EXIT_NAME, HEARTBEAT_NAME, Heartbeat, Progress, announce_start, write_json_atomic


def read(path):
    return json.loads(path.read_text())


def test_heartbeat_written_at_start_and_time_advances(tmp_path):
    hb = Heartbeat(tmp_path, Progress(0, 2, "x"), interval_s=0.1).start()
    try:
        first = read(tmp_path / HEARTBEAT_NAME)  # written synchronously by start()
        assert (first["shard"], first["num_shards"], first["version"], first["pid"]) == (0, 2, "x", os.getpid())
        hb.progress.samples_done = 5
        time.sleep(0.5)
        later = read(tmp_path / HEARTBEAT_NAME)
        deadline = time.monotonic() + 2.5  # slack for a loaded CI host; a dead heartbeat still fails
        while later["time"] <= first["time"] and time.monotonic() < deadline:
            time.sleep(0.05)
            later = read(tmp_path / HEARTBEAT_NAME)
        assert later["time"] > first["time"]
        assert later["samples_done"] == 5, "the heartbeat publishes live counters"
    finally:
        hb.finish(0, "ok")


def test_finish_writes_exit_status(tmp_path):
    hb = Heartbeat(tmp_path, Progress(0, 2, "x"), interval_s=0.1).start()
    hb.finish(3, "why")
    status = read(tmp_path / EXIT_NAME)
    assert (status["code"], status["reason"], status["pid"]) == (3, "why", os.getpid())
    assert read(tmp_path / HEARTBEAT_NAME)["phase"] == "failed"
    # the heartbeat has stopped: the file no longer changes
    mtime = (tmp_path / HEARTBEAT_NAME).stat().st_mtime_ns
    time.sleep(0.3)
    assert (tmp_path / HEARTBEAT_NAME).stat().st_mtime_ns == mtime


def test_finish_success_phase_done(tmp_path):
    hb = Heartbeat(tmp_path, Progress(1, 2, "x"), interval_s=0.1).start()
    hb.finish(0, "complete")
    assert read(tmp_path / EXIT_NAME)["code"] == 0
    assert read(tmp_path / HEARTBEAT_NAME)["phase"] == "done"


def test_start_removes_stale_exit_status(tmp_path):
    write_json_atomic(tmp_path / EXIT_NAME, {"code": 1, "reason": "previous run"})
    hb = Heartbeat(tmp_path, Progress(0, 2, "x"), interval_s=0.1).start()
    try:
        assert not (tmp_path / EXIT_NAME).exists()
    finally:
        hb.finish(0, "ok")


def test_finish_without_status_dir_writes_nothing(tmp_path):
    missing = tmp_path / "never-made"
    Heartbeat(missing, Progress(0, 2, "x"), interval_s=0.1).finish(2, "bad arguments")
    assert not missing.exists()


def test_write_json_atomic_replaces_and_leaves_no_temp_files(tmp_path):
    target = tmp_path / "status.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"b": [1, 2], "c": "ü"})
    assert read(target) == {"b": [1, 2], "c": "ü"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_announce_start(capsys):
    announce_start(0, 2, "9.9.9")
    out = capsys.readouterr().out
    assert out.startswith("STARTED shard=0/2 pid=")
    assert out == f"STARTED shard=0/2 pid={os.getpid()} version=9.9.9\n"


def test_startup_milestones_count_from_the_process_start_once_each():
    """`Progress.mark` keeps the first time a milestone is reached, from the process's own start (read from
    /proc: earlier than this module's import); every phase entered is one; a new dict each time, so the
    heartbeat's thread never reads one that changes under it."""
    from hsextract.run import liveness

    assert liveness.PROCESS_START <= liveness.IMPORTED_AT < liveness.PROCESS_START + 120
    assert liveness.process_started_at() == pytest.approx(liveness.PROCESS_START, abs=0.05)
    progress = Progress(0, 1, "x")
    assert progress.startup == {}  # the initial "starting" is not a milestone
    progress.phase = "importing"
    before = progress.startup
    time.sleep(0.02)
    progress.mark("model_loaded")
    progress.phase = "importing"  # entered again: the first time stays
    assert list(progress.startup) == ["importing", "model_loaded"] and before == {"importing": before["importing"]}
    assert progress.startup["importing"] < progress.startup["model_loaded"]
    assert progress.startup["model_loaded"] == pytest.approx(time.time() - liveness.PROCESS_START, abs=0.05)
    assert progress.snapshot()["startup"] == progress.startup
    assert progress.describe_startup() == (f"importing {progress.startup['importing']:.1f}s, "
                                           f"model_loaded {progress.startup['model_loaded']:.1f}s")
