"""Supervision that scales with hosts: the shards of a host share one SSH connection and one probe round trip
per interval (tasks/monitor.py). A real sshd that logs every connection it accepts, the real flow, a real
Prefect server, the real worker."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import hsextract
from flows.extract import extract
from harness.inventory import ssh_host_entry, write_inventory
from harness.sshd import SshdFarm
from harness.worker import dataset_ids, proc_stat
from hsextract import tiny
from hsextract.errors import Retry

FAST = dict(heartbeat_interval_s=0.5, poll_interval_s=0.3, launch_timeout_s=30, stall_timeout_s=20,
            host_timeout_s=10)


@pytest.fixture(scope="module")
def counting_farm():
    with SshdFarm(log_level="INFO") as farm:
        farm.add_host("f1")
        yield farm


def test_the_shards_of_a_host_share_one_connection(prefect_server, counting_farm, tiny_model, tmp_path):
    data = tiny.build_dataset(tmp_path / "chat.jsonl", 80, seed=3)
    host = counting_farm.host("f1")
    inventory = write_inventory(tmp_path / "hosts.yaml", [ssh_host_entry(host, tmp_path / "w", gpus=(0, 1, 2, 3))])
    before = counting_farm.connections("f1")
    state = extract(return_state=True, **FAST, model=str(tiny_model), data=str(data), output=f"file://{tmp_path}/out",
                    hosts=str(inventory), layers="1,3", run_name="shared", synthetic_tokens_per_s=2000.0)
    assert state.is_completed(), state.message
    assert set(state.result()["shards"].values()) == {"done"} and len(state.result()["shards"]) == 4
    assert Counter(s["id"] for s in hsextract.read_samples(tmp_path / "out", verify=True)) == Counter(
        dataset_ids(data))
    # the deploy (bundle, environment and input checks) has one; the shards' launches, readings and clean-ups
    # share the other, whatever the number of shards (each shard's launch and supervise task opened its own before)
    made = counting_farm.connections("f1") - before
    assert made <= 2, f"{made} SSH connections for 4 shards on one host"


class _Job:
    """What a monitor needs of a shard: its number, control dir and journal."""

    def __init__(self, shard: int, control, journal, host="here"):
        self.shard, self.control_dir, self.journal, self.host = shard, str(control), str(journal), host


def _inventory(tmp_path, **hosts):
    import yaml

    from tasks.inventory import parse_inventory

    entries = [{"name": name, "gpus": [0], "workdir": str(tmp_path / name), "python": "python3", **spec}
               for name, spec in hosts.items()]
    return parse_inventory(yaml.safe_dump({"hosts": entries}))


def test_one_round_trip_per_interval_serves_every_shard_of_the_host(tmp_path):
    import subprocess
    import threading
    import time

    from tasks.monitor import HostPool

    sleeper = subprocess.Popen(["sleep", "60"])
    cancel = threading.Event()
    try:
        start = proc_stat(sleeper.pid)[19]
        jobs = []
        for n in range(4):
            control = tmp_path / f"c{n}"
            control.mkdir()
            (control / "pid").write_text(str(sleeper.pid))
            (control / "pid.start").write_text(start)
            (control / "heartbeat.json").write_text(f'{{"time": 1, "samples_done": {n}}}')
            jobs.append(_Job(n, control, tmp_path / f"j{n}"))
        with HostPool(_inventory(tmp_path, here={"hostname": "local"}), 0.2, 10, cancel) as pool:
            watches = [pool.watch(job) for job in jobs]
            began = time.monotonic()
            for _ in range(5):
                for n, watch in enumerate(watches):
                    state = watch.next(cancel)
                    assert state.alive and state.pid == sleeper.pid and state.heartbeat["samples_done"] == n
            trips = pool.stats()["round_trips"]
            assert 5 <= trips <= 7, trips  # one per interval for all four shards (not four per interval)
            assert time.monotonic() - began >= 4 * 0.2  # paced by the interval
            # a cancel wakes every waiter at once
            t0 = time.monotonic()
            cancel.set()
            assert watches[1].next(cancel) is None and time.monotonic() - t0 < 1.5
            for watch in watches:
                watch.close()
    finally:
        sleeper.kill()


def test_an_unreachable_host_gives_every_shard_the_round_trips_error(tmp_path):
    import socket
    import threading

    from tasks.hosts import HostError
    from tasks.monitor import HostPool

    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inventory = _inventory(tmp_path, gone={"hostname": "127.0.0.1", "port": port, "accept_unknown_host_keys": True})
    cancel = threading.Event()
    with HostPool(inventory, 0.2, 5, cancel) as pool:
        watches = [pool.watch(_Job(n, tmp_path / f"c{n}", tmp_path / "j", host="gone")) for n in range(2)]
        errors = []
        for watch in watches:
            with pytest.raises(HostError) as caught:
                watch.next(cancel)
            errors.append(caught.value)
        assert errors[0] is not errors[1]  # each shard its own copy
        # (the first round trip may have begun before the second shard was watched)
        assert all(e.retry is Retry.NOW and re.search(r"the probe of its [12] shard\(s\)", str(e)) and f":{port}" in str(e)
                   for e in errors), [str(e) for e in errors]
        assert pool.stats()["connections"] == 0


def test_progress_artifacts_are_updated_at_a_bounded_rate_whatever_the_shard_count(prefect_server, tmp_path):
    import time

    from prefect import flow

    from hsextract.store import LocalStore
    from tasks.attempts import AttemptRecord
    from tasks.board import PROGRESS_UPDATES_PER_S, Board

    shards = list(range(64))

    @flow
    def beats() -> tuple[int, float]:
        board = Board("bounded", len(shards), shards, AttemptRecord(LocalStore(tmp_path), "bounded", len(shards)))
        began = time.monotonic()
        for step in range(1, 4):  # every shard's progress changes three times, as fast as readings come
            for shard in shards:
                board.beat(shard, {"samples_done": step, "samples_total": 10}, 0.1)
        return board.progress_updates, time.monotonic() - began

    updates, seconds = beats()
    assert 1 <= updates <= PROGRESS_UPDATES_PER_S * (1 + seconds) + 1, (updates, seconds)
