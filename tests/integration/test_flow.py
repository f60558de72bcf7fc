"""The `extract` flow on a real Prefect server over real SSH hosts (and the local host)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import pytest

import hsextract
from flows.extract import extract
from hsextract import tiny

from harness.worker import dataset_ids
from harness.inventory import ssh_host_entry, write_inventory

FAST = dict(heartbeat_interval_s=0.5, poll_interval_s=0.3, launch_timeout_s=30, stall_timeout_s=20,
            host_timeout_s=10)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny.build_dataset(tmp_path_factory.mktemp("flowdata") / "chat.jsonl", 160, seed=9)


def run_flow(**kwargs):
    return extract(return_state=True, **{**FAST, **kwargs})


def test_two_hosts_two_shards_each_exactly_once_then_continue(prefect_server, farm, tiny_model, data, tmp_path):
    hosts = write_inventory(tmp_path / "hosts.yaml", [ssh_host_entry(farm.host(n), tmp_path / f"w-{n}")
                                                      for n in ("h1", "h2")])
    out = f"file://{tmp_path / 'out'}"
    state = run_flow(model=str(tiny_model), data=str(data), output=out, hosts=str(hosts), layers="1,3",
                     run_name="r1")
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["num_shards"] == 4 and set(summary["shards"].values()) == {"done"}
    ids = Counter(s["id"] for s in hsextract.read_samples(tmp_path / "out", verify=True))
    assert ids == Counter(dataset_ids(data))
    journals = sorted(p.parent.name for p in (tmp_path / "out").glob("shard-*/journal.jsonl"))
    assert journals == [f"shard-{i:05d}-of-00004" for i in range(4)]
    # nothing the product made is open to others, or writable by the group (workdirs, code, logs, output)
    made = [p for root in ("w-h1", "w-h2", "out") for p in [tmp_path / root, *(tmp_path / root).rglob("*")]]
    assert len(made) > 50
    assert [f"{oct(p.lstat().st_mode & 0o777)} {p}" for p in made if p.lstat().st_mode & 0o027] == []
    # same run name and output: nothing is redone
    state = run_flow(model=str(tiny_model), data=str(data), output=out, hosts=str(hosts), layers="1,3",
                     run_name="r1")
    assert state.is_completed() and set(state.result()["shards"].values()) == {"done (already complete)"}


def test_local_host_flow(prefect_server, tiny_model, data, tmp_path):
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0, 1, 2],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    state = run_flow(model=str(tiny_model), data=str(data), output=f"file://{tmp_path / 'out'}", hosts=str(hosts),
                     layers="eagle3+last", include_last=True)  # what both trainers' exports need, in one run
    assert state.is_completed(), state.message
    samples = list(hsextract.read_samples(tmp_path / "out"))
    assert len(samples) == 160 and all(s["hidden_states"].shape[1] == 4 * 64 for s in samples)
    assert all(s["last_hidden_state"].shape == (s["input_ids"].shape[0], 64) for s in samples)
    for fmt in ("specforge-eagle3", "speculators"):
        done = subprocess.run([sys.executable, "-m", "hsextract", "export", str(tmp_path / "out"),
                               str(tmp_path / fmt), "--format", fmt], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "exported 160 of 160" in done.stdout, done.stderr


def test_reconcile_seals_the_run_and_a_lost_object_is_redone(prefect_server, tiny_model, data, tmp_path):
    import json

    from prefect.client.orchestration import get_client

    from tasks.reconcile import INDEX_NAME, SUCCESS_NAME

    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0, 1],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    out = tmp_path / "out"
    kwargs = dict(model=str(tiny_model), data=str(data), output=f"file://{out}", hosts=str(hosts), layers="1,3",
                  token_budget=512, run_name="sealed")
    state = run_flow(**kwargs)
    assert state.is_completed(), state.message
    rec = state.result()["reconcile"]
    assert rec["complete"] and rec["sealed"] and rec["missing"] == 0 and (out / SUCCESS_NAME).is_file()
    assert sum(1 for _ in (out / INDEX_NAME).open()) == rec["done"] == 160
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    wanted = {"reconcile-sealed-shards", "reconcile-sealed-summary"}
    with get_client(sync_client=True) as client:  # by key: an unfiltered read stops at the page size (200)
        keys = {a.key for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=sorted(wanted))))}
    assert keys == wanted

    # an object disappears from the store: reconcile fails the run naming the shard, the re-run redoes it
    (out / SUCCESS_NAME).unlink()
    journal = out / "shard-00001-of-00002" / "journal.jsonl"
    lost = next(json.loads(l) for l in journal.read_text().splitlines() if '"kind":"file"' in l)
    (journal.parent / lost["file"]).unlink()
    state = run_flow(**kwargs)
    assert state.is_failed()
    message = str(pytest.raises(Exception, state.result).value)
    assert f"reconcile found {len(lost['ids'])} sample(s) missing" in message and "re-run of shard(s) [1] requested" in message
    state = run_flow(**kwargs)
    assert state.is_completed(), state.message
    rec = state.result()["reconcile"]
    assert rec["complete"] and rec["sealed"] and rec["duplicated"] == 0
    assert sorted(s["id"] for s in hsextract.read_samples(out)) == sorted(
        json.loads(line)["id"] for line in (out / INDEX_NAME).open())


def test_silent_launch_fails_flow_fast_with_reason(prefect_server, farm, tiny_model, data, tmp_path):
    # an interpreter that passes deploy's checks but exits 0 at once, printing nothing, when asked to extract
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\n[ \"$3\" = extract ] && exit 0\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    hosts = write_inventory(tmp_path / "hosts.yaml", [ssh_host_entry(farm.host("lo"), tmp_path / "w", gpus=[0],
                                                                     python=str(wrapper))])
    started = time.monotonic()
    state = run_flow(model=str(tiny_model), data=str(data), output=f"file://{tmp_path / 'out'}", hosts=str(hosts),
                     layers="1,3")
    elapsed = time.monotonic() - started
    assert state.is_failed()
    message = state.message + str(pytest.raises(Exception, state.result).value)
    assert "shard 0/1 on lo" in message and "exited at once, printing no STARTED line" in message
    assert elapsed < 30, f"{elapsed:.1f}s from flow start to Failed"


def test_unhealthy_host_skipped_for_healthy_one(prefect_server, farm, tiny_model, data, tmp_path):
    entries = [ssh_host_entry(farm.host("h1"), tmp_path / "w1", gpus=[0], python="/nonexistent/python3"),
               ssh_host_entry(farm.host("h2"), tmp_path / "w2", gpus=[0])]
    hosts = write_inventory(tmp_path / "hosts.yaml", entries)
    state = run_flow(model=str(tiny_model), data=str(data), output=f"file://{tmp_path / 'out'}", hosts=str(hosts),
                     layers="1,3", num_shards=2)
    assert state.is_failed(), "the broken host is reported even though its shards ran elsewhere"
    message = str(pytest.raises(Exception, state.result).value)
    assert "host h1" in message and "/nonexistent/python3" in message
    assert "every shard is done, but 1 host(s) failed" in message and "\n- shard" not in message, \
        "no shard failed: both ran on h2"
    assert len(list(hsextract.read_samples(tmp_path / "out"))) == 160


def test_bad_parameters_rejected_before_anything_runs(prefect_server, tmp_path):
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "x", "hostname": "local", "gpus": [],
                                                       "workdir": "rel"}])
    state = run_flow(model="m", data="d", output="file:///tmp/x", hosts=str(hosts))
    message = str(pytest.raises(Exception, state.result).value)
    assert state.is_failed() and "host x.gpus" in message and "host x.workdir" in message


def test_inventory_from_a_block(prefect_server, tiny_model, data, tmp_path):
    from tasks.blocks import HostInventory

    text = (f"hosts:\n  - name: local\n    hostname: local\n    gpus: [0]\n    workdir: {tmp_path / 'w'}\n"
            f"    python: {sys.executable}\n")
    HostInventory(yaml=text).save("test-fleet", overwrite=True)
    state = run_flow(model=str(tiny_model), data=str(data), output=f"file://{tmp_path / 'out'}", hosts="test-fleet",
                     layers="1,3")
    assert state.is_completed(), state.message
    state = run_flow(model=str(tiny_model), data=str(data), output=f"file://{tmp_path / 'o2'}", hosts="no-such-block")
    assert "neither an inventory file nor a HostInventory block" in str(pytest.raises(Exception, state.result).value)


def test_a_shard_goes_elsewhere_than_the_host_it_last_failed_on(prefect_server, tiny_model, data, tmp_path):
    silent = tmp_path / "python-silent"
    silent.write_text(f"#!/bin/sh\ncase \" $* \" in *\" extract \"*) exit 0 ;; esac\nexec {sys.executable} \"$@\"\n")
    silent.chmod(0o755)
    hosts = write_inventory(tmp_path / "hosts.yaml", [
        {"name": "bad", "hostname": "local", "gpus": [0], "workdir": str(tmp_path / "wa"), "python": str(silent)},
        {"name": "good", "hostname": "local", "gpus": [0], "workdir": str(tmp_path / "wb"), "python": sys.executable}])
    kwargs = dict(model=str(tiny_model), data=str(data), output=f"file://{tmp_path / 'out'}", hosts=str(hosts),
                  layers="1,3", num_shards=1, run_name="placed")
    first = run_flow(**kwargs)
    assert first.is_failed() and "shard 0/1 on bad" in str(pytest.raises(Exception, first.result).value)
    second = run_flow(**kwargs)  # the first free slot is still on `bad`: the shard takes `good`'s
    assert second.is_completed(), second.message
    from harness.prefect import shard_table

    row = shard_table("placed")[0]
    assert row["host"] == "good" and row["failed_attempts"] == 1 and row["last_failed_host"] == "bad"


def _attempts(out) -> dict:
    import json

    return {name: entry["failed_attempts"] for name, entry in
            json.loads((out / "_runs" / "mistake" / "attempts.json").read_text()).items()}


def test_a_bad_input_or_one_error_on_every_shard_is_not_retried(prefect_server, tiny_model, data, tmp_path):
    """A worker's exit 2 (weights missing) and one worker error on every shard: the run fails with a short
    message saying so, asks for no re-run and counts no attempt; a lost worker is still retried."""
    import shutil

    from harness import faulty
    from harness.prefect import run_events, wait_until

    def hosts(python: str = sys.executable):
        return str(write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0, 1],
                                                              "workdir": str(tmp_path / "w"), "python": python}]))

    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    sorted(broken.glob("*.safetensors"))[-1].unlink()  # the config is fine: the preflight passes, the load fails
    for name, model, python, why in (
            ("weights", broken, sys.executable, "exited with code 2: usage: --model"),
            ("same", tiny_model, faulty.python_for(tmp_path / "python", {faulty.FAIL_WITH: "checkpoint format 7 "
                                                                         "is not supported"}),
             "exited with code 1: RuntimeError: checkpoint format 7 is not supported")):
        out = tmp_path / f"out-{name}"
        state = run_flow(model=str(broken if model is broken else model), data=str(data), output=f"file://{out}",
                         hosts=hosts(python), layers="1,3", run_name="mistake")
        assert state.is_failed()
        message = state.message
        assert message.startswith("run mistake: 2 of 2 shard(s) failed; not retried (a re-run cannot fix this)"), message
        assert "- shards 0-1 of 2 on local: worker" in message and why in message and message.count(why) == 1, message
        assert "evidence: artifact failure-mistake" in message and len(message.splitlines()) == 3, message
        assert _attempts(out) == {"shard-00000-of-00002": 0, "shard-00001-of-00002": 0}, "no attempt burned"
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        failed = wait_until(lambda: [e for e in run_events(client, "extract.run.failed", "mistake")
                                     if "not supported" in e.resource["prefect.resource.name"]], 30,
                            "the second run's extract.run.failed event naming its cause")
        assert not run_events(client, "extract.run.incomplete", "mistake"), "no re-run asked for"
    assert "(and" not in failed[-1].resource["prefect.resource.name"], "one cause on every shard: one cause told"
