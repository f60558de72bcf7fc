"""Shared fixtures: a tiny real model and tokenizer built and saved once, and the real CLI as a subprocess."""

from __future__ import annotations

import os
from pathlib import Path

# One intra-op thread per torch process, before anything imports torch: the suite runs many workers at once on
# a few cores, and torch's thread pools then oversubscribe them (the tiny model's forward: 1,700 tok/s with 2
# threads per process vs 12,900 with 1, on 2 cores under the suite's load). The sshd hosts pass it on.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from hsextract import tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Qwen3.5 hybrid (Gated DeltaNet + full attention every 4th layer), 8 layers, random weights."""
    return tiny.build_model(tmp_path_factory.mktemp("model") / "qwen3_5_tiny", kind="qwen3_5_text")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    return tiny.build_dataset(tmp_path_factory.mktemp("data") / "chat.jsonl", 120, seed=1)


@pytest.fixture(scope="session")
def farm():
    """Real OpenSSH servers: two hosts in their own network namespaces (loopback if unavailable) + one on lo."""
    from harness.sshd import SshdFarm

    with SshdFarm() as farm:
        farm.add_host("h1", netns=True)
        farm.add_host("h2", netns=True)
        farm.add_host("lo")
        yield farm


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect server (SQLite) for the whole session."""
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 HTTP endpoint: moto's ThreadedMotoServer on a free loopback port (conditional writes atomic, as
    S3's are: `harness.moto_s3`). Yields its URL."""
    from harness.moto_s3 import start_server

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = start_server()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, request):
    """A boto3 client on the endpoint and a fresh bucket named after the test."""
    import re

    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-")
    client.create_bucket(Bucket=bucket)
    return client, bucket


#: the files that take longest (scripts/test.sh's "longest files", on 2 cores), longest first. The parallel run
#: hands out whole files in collection order (`--dist loadfile --no-loadscope-reorder`): started first, the long
#: ones overlap the many short ones instead of holding the run's end alone. A file not named keeps its place after
#: them; a stale list only costs time. test_cancel.py is long in wall time but mostly waits on its workers' signals:
#: early, its process's idle time falls while the others have work for both cores.
LONGEST_FIRST = ("test_deployment.py", "test_cancel.py", "test_integrity.py", "test_fault_matrix.py",
                 "test_s3_output.py", "test_launch.py", "test_flow.py", "test_ui.py", "test_cli.py", "test_export.py",
                 "test_resume.py", "test_prewarm.py", "test_flow_s3.py", "test_stage_inputs.py")


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration is `slow` (real servers, hosts, workers): `-m 'not slow'` leaves the
    pure tests, the inner loop. The files in LONGEST_FIRST are collected first, in its order (a stable sort: each
    file's tests keep theirs)."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sum each file's set-up, call and tear-down time (on the controller, under xdist too)."""
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With --durations: the 12 files that took longest in all (with --dist loadfile, a file's tests run in
    one process: the parallel run can end no sooner than its longest file)."""
    if config.getoption("durations", None) is None or len(_FILE_SECONDS) < 2:
        return
    terminalreporter.write_sep("=", "longest files (set-up + tests + tear-down, summed)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:12]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
