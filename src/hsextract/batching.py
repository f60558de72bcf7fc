"""Token-budget batches: samples sorted by length within a window, packed until the padded size is full."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import TypeVar

S = TypeVar("S", bound=Sized)


def padded_tokens(batch: list[Sized]) -> int:
    """Tokens a right-padded batch occupies: its longest sample times its size."""
    return max(len(s) for s in batch) * len(batch)


def pack(samples: Iterable[S], token_budget: int, window: int = 1024) -> Iterator[list[S]]:
    """Yield batches whose padded size (longest x count) stays within `token_budget`.

    A sample longer than the budget goes alone. Within each window of `window` samples the longest go
    first; the window's last, partly filled batch is carried into the next window instead of being cut.
    """
    buffer: list[S] = []
    fresh = 0  # samples added since the last packing (the carried batch does not count)
    for sample in samples:
        buffer.append(sample)
        fresh += 1
        if fresh >= window:
            *full, buffer = list(_pack_sorted(buffer, token_budget))
            fresh = 0
            yield from full
    if buffer:
        yield from _pack_sorted(buffer, token_budget)


def _pack_sorted(samples: list[S], token_budget: int) -> Iterator[list[S]]:
    batch: list[S] = []
    for sample in sorted(samples, key=len, reverse=True):
        if batch and len(batch[0]) * (len(batch) + 1) > token_budget:
            yield batch
            batch = []
        batch.append(sample)
    if batch:
        yield batch
