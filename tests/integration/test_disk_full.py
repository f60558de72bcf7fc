"""The output disk fills up mid-run: the worker fails fast naming it, keeps what it wrote, and a re-run
with room finishes the rest without recomputing it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import hsextract
from hsextract.store import sha256_file
from hsextract.output.journal import read_entries

from harness.worker import dataset_ids, run_extract, summary_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0750", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_fails_fast_and_resumes(tiny_model, dataset, small_disk):
    out = small_disk / "out"
    args = (tiny_model, dataset, out, 0, 1, "--token-budget", "256")
    proc = run_extract(*args, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No space left on device" in proc.stderr and "batch-" in proc.stderr, proc.stderr
    shard = out / "shard-00000-of-00001"
    status = json.loads((shard / "exit.json").read_text())  # the failed temp file was removed: room for it
    assert status["code"] == 1 and "No space left on device" in status["reason"] and ".tmp" in status["reason"]
    files = [e for e in read_entries(shard / "journal.jsonl") if e["kind"] == "file"]
    assert files, "nothing was written before the disk filled up"
    for entry in files:  # every journaled file is whole; nothing else is left behind
        assert sha256_file(shard / entry["file"]) == entry["sha256"]
    assert {p.name for p in shard.glob("batch-*")} == {e["file"] for e in files}
    assert not list(shard.glob(".batch-*.tmp"))
    kept = sum(len(e["ids"]) for e in files)

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = run_extract(*args, timeout=300)
    assert again.returncode == 0, again.stderr
    summary = summary_of(again)
    assert summary["samples_written"] == len(dataset_ids(dataset)) - kept  # what was kept is not redone
    assert sorted(s["id"] for s in hsextract.read_samples(out)) == sorted(dataset_ids(dataset))
