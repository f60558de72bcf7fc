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
