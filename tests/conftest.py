"""Shared fixtures: a tiny real model and tokenizer built and saved once, and the real CLI as a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsextract import tiny

ROOT = Path(__file__).resolve().parents[1]


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
    from sshhosts import SshdFarm

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
