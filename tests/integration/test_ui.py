"""The Prefect UI as a person meets it: `deployments.demo --served`, a good run and a run with a typo in the
model path, read through the API and by a headless Chromium (tests/harness/ui.py)."""

from __future__ import annotations

import json

import pytest

from harness.ui import look


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    work = tmp_path_factory.mktemp("ui")
    return look(work, work / "shots")


def test_the_ui_reaches_its_api(seen):
    assert seen["ui_settings"]["api_url"] == seen["ui"] + "/api", seen["ui_settings"]
    assert seen["api_health"] is True
    for name, page in seen["pages"].items():
        assert "Unable to connect" not in page["text"], (name, page["text"][:500])


def test_a_good_run_reads_as_one_job_with_its_progress(seen):
    (run,) = seen["demo"]["runs"]
    assert run["name"] == "demo" and run["state"] == "COMPLETED" and "run:demo" in run["tags"]
    status = seen["demo"]["status"]
    assert status["versions"] == 1, "one card per flow run, updated in place"
    assert "complete, 100.0% of samples" in status["data"] and "48 of 48 done" in status["data"], status["data"]
    table = json.loads(seen["demo"]["shards"]["data"])
    assert seen["demo"]["shards"]["versions"] == 1 and len(table) == 2
    assert list(table[0])[:4] == ["shard", "state", "samples", "host"] and "files_uploaded" not in table[0]
    assert {r["state"] for r in table} == {"done"} and all(r["samples"] != "-" for r in table)
    done = [e for e in seen["demo"]["events"] if e["event"] == "extract.shard.done"]
    assert len(done) == 2 and all("samples" in e["resource"]["prefect.resource.name"] for e in done), done
    deployment = [r for r in done[0]["related"] if r["prefect.resource.role"] == "deployment"]
    assert deployment and deployment[0]["prefect.resource.name"] == "extract/qwen", done[0]["related"]
    assert "demo" in seen["pages"]["good-run"]["text"] and "Completed" in seen["pages"]["good-run"]["text"]
    assert "100.0% of samples" in seen["pages"]["status"]["text"]


def test_a_typo_fails_fast_once_with_a_short_reason(seen):
    (run,) = seen["typo"]["runs"]  # no automated re-run of a mistake no re-run can fix
    message = run["message"]
    assert run["state"] == "FAILED" and run["name"] == "typo" and "run:typo" in run["tags"]
    assert "modle': no such directory" in message and "not retried" in message, message
    assert "failure-typo" in message and len(message) < 400, (len(message), message)
    assert message.count("no such directory") <= 2, message
    assert "no such directory" in seen["typo_watch"] and seen["typo_rc"] == 1, seen["typo_watch"]
    assert seen["typo_s"] < 120, seen["typo_s"]
    assert all(entry["failed_attempts"] == 0 for entry in seen["typo"]["attempts"].values()), seen["typo"]["attempts"]
    evidence = seen["typo"]["failure"]["data"]
    assert "hsextract check" in evidence and "no such directory" in evidence
    assert "no such directory" in seen["typo"]["status"]["data"]
    assert "no such directory" in seen["pages"]["failed-run"]["text"], seen["pages"]["failed-run"]["text"][:2000]
    assert "no such directory" in seen["pages"]["failed-status"]["text"]
