"""Completion by sample id: kill -9 at any moment, re-shard, change the batch size -> exactly once."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter

import pytest

import hsextract
from hsextract import tiny
from hsextract.output.journal import read_entries
from hsextract.output.journal import scan

from harness.worker import dataset_ids, extract_cmd, run_extract, summary_of


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory):
    return tiny.build_dataset(tmp_path_factory.mktemp("big") / "chat.jsonl", 400, seed=5)


def journaled_files(out) -> int:
    return sum(1 for j in out.glob("shard-*/journal.jsonl") for e in read_entries(j) if e["kind"] == "file")


def start_and_kill(cmd, out, after_files: int, sig=signal.SIGKILL, deadline_s: float = 120) -> int:
    """Start the CLI, wait until `after_files` files are journaled, then send `sig`; returns the exit code."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    start = time.monotonic()
    while journaled_files(out) < after_files:
        assert proc.poll() is None, f"worker ended before it could be killed: {proc.communicate()}"
        assert time.monotonic() - start < deadline_s
        time.sleep(0.01)
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    return proc.returncode


def ids_written(out) -> Counter:
    return Counter(i for _, entry in scan(out).files for i in entry["ids"])


def assert_exactly_once(out, data):
    read = Counter(s["id"] for s in hsextract.read_samples(out))
    assert read == Counter(dataset_ids(data)), "every dataset sample exactly once"
    written = ids_written(out)
    assert max(written.values()) == 1, f"samples written twice: {[i for i, n in written.items() if n > 1][:5]}"


def test_kill9_repeatedly_then_rerun_exactly_once(tiny_model, big_dataset, tmp_path):
    out = tmp_path / "out"
    cmd = extract_cmd(tiny_model, big_dataset, out, 0, 1, "--token-budget", "300")
    for after in (2, 9, 17):
        assert start_and_kill(cmd, out, after) == -signal.SIGKILL
        assert not (out / "shard-00000-of-00001" / "exit.json").exists(), "kill -9 leaves no exit status"
    before = journaled_files(out)
    done_before = sum(ids_written(out).values())
    proc = run_extract(tiny_model, big_dataset, out, 0, 1, "--token-budget", "300")
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["samples_written"] == 400 - done_before, "finished samples are not recomputed"
    assert summary["samples_done"] == 400
    assert journaled_files(out) > before
    assert not list(out.glob("shard-*/.batch-*.tmp")), "no temp files survive"
    assert_exactly_once(out, big_dataset)


def test_reshard_3_to_2_with_other_budget_no_recompute(tiny_model, big_dataset, tmp_path):
    out = tmp_path / "out"
    for shard in (0, 1):
        assert run_extract(tiny_model, big_dataset, out, shard, 3, "--token-budget", "600").returncode == 0
    assert start_and_kill(extract_cmd(tiny_model, big_dataset, out, 2, 3, "--token-budget", "300"), out, 8) < 0
    old = set(ids_written(out))
    assert 0 < len(old) < 400
    summaries = []
    for shard in (0, 1):
        proc = run_extract(tiny_model, big_dataset, out, shard, 2, "--token-budget", "2000")
        assert proc.returncode == 0, proc.stderr
        summaries.append(summary_of(proc))
    assert sum(s["samples_written"] for s in summaries) == 400 - len(old)
    new_ids = Counter(i for shard, e in scan(out).files if shard.endswith("of-00002") for i in e["ids"])
    assert not (set(new_ids) & old), "a sample finished under 3 shards was computed again under 2"
    assert sum(s["forward_passes"] for s in summaries) == sum(s["files"] for s in summaries)
    assert_exactly_once(out, big_dataset)
    # a third run finds nothing to do
    proc = run_extract(tiny_model, big_dataset, out, 0, 2)
    assert proc.returncode == 0 and summary_of(proc)["forward_passes"] == 0


def test_sigterm_finishes_cleanly_and_reports(tiny_model, big_dataset, tmp_path):
    out = tmp_path / "out"
    code = start_and_kill(extract_cmd(tiny_model, big_dataset, out, 0, 1, "--token-budget", "300"), out, 3,
                          sig=signal.SIGTERM)
    assert code == 128 + signal.SIGTERM
    import json

    status = json.loads((out / "shard-00000-of-00001" / "exit.json").read_text())
    assert status["code"] == 143 and "SIGTERM" in status["reason"]
    assert not list(out.glob("shard-*/.batch-*.tmp"))
    journaled = {e["file"] for e in read_entries(out / "shard-00000-of-00001" / "journal.jsonl") if e["kind"] == "file"}
    on_disk = {p.name for p in out.glob("shard-*/batch-*.safetensors")}
    assert on_disk == journaled, "every file on disk is journaled and vice versa"
    assert run_extract(tiny_model, big_dataset, out, 0, 1).returncode == 0
    assert_exactly_once(out, big_dataset)
