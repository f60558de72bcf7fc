"""Deterministic assignment of sample ids to shards (independent of file order and batch size)."""

from __future__ import annotations

import hashlib


def shard_of(sample_id: str, num_shards: int) -> int:
    """The shard a sample id belongs to, of `num_shards`: a hash of the id (independent of file order)."""
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_shards
