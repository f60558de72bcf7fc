"""Token-budget batches: samples sorted by length within a window, packed until the padded size is full."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import TypeVar

S = TypeVar("S", bound=Sized)


def padded_tokens(batch: Sequence[Sized]) -> int:
    """Tokens a right-padded batch occupies: its longest sample times its size."""
    return max(len(s) for s in batch) * len(batch)


def pack(samples: Iterable[S], token_budget: int, window: int = 1024) -> Iterator[list[S]]:
    """Yield batches whose padded size (longest x count) stays within `token_budget`.

    A sample longer than the budget goes alone. Within each window of `window` samples the longest go
    first; the window's last, partly filled batch is carried into the next window instead of being cut.
    Batch sizes are bucketed (`batch_size_bucket`): a batch holds at most as many samples as fit, rounded
    down to the nearest allowed size.
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


def batch_size_bucket(n: int) -> int:
    """The largest allowed batch size <= n: every size up to 8, then 4..7 x a power of two (10, 12, 14, 16,
    20, 24, ...), each at least 4/5 of the next. A GPU kernel that autotunes per batch size (fla's cumsum
    keys on it) then meets a few dozen sizes in a whole run, all of which the worker warms at start."""
    if n <= 8:
        return max(1, n)
    shift = n.bit_length() - 3
    return (n >> shift) << shift


def batch_size_buckets(limit: int) -> list[int]:
    """Every allowed batch size up to `limit`."""
    return sorted({batch_size_bucket(n) for n in range(1, limit + 1)})


def _pack_sorted(samples: list[S], token_budget: int) -> Iterator[list[S]]:
    ordered = sorted(samples, key=len, reverse=True)
    start = 0
    while start < len(ordered):
        fit = max(1, token_budget // max(1, len(ordered[start])))  # the longest first: the rest fit as well
        size = batch_size_bucket(min(fit, len(ordered) - start))
        yield ordered[start:start + size]
        start += size
