"""The `extract` flow on a real Prefect server over real SSH hosts (and the local host)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import hsextract
from flows.extract import extract
from hsextract import tiny

from helpers import dataset_ids, ssh_host_entry, write_inventory

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
    # same run name and output: nothing is redone
    state = run_flow(model=str(tiny_model), data=str(data), output=out, hosts=str(hosts), layers="1,3",
                     run_name="r1")
    assert state.is_completed() and set(state.result()["shards"].values()) == {"done (already complete)"}


def test_local_host_flow(prefect_server, tiny_model, data, tmp_path):
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0, 1, 2],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    state = run_flow(model=str(tiny_model), data=str(data), output=f"file://{tmp_path / 'out'}", hosts=str(hosts),
                     layers="eagle3")
    assert state.is_completed(), state.message
    assert len(list(hsextract.read_samples(tmp_path / "out"))) == 160


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
    assert "1 failure(s)" in message and "\n- shard" not in message, "no shard failed: both ran on h2"
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
