"""The worker's checks of a batch's states alone, on one batch of the 32-layer worker's shape (8192 tokens, 5
captured layers of width 5120, bf16): the checks of before issue 38 (NaN/Inf flags), the three-pass form of the
layer statistics beside them, and `ShardRun.check_states` (two passes for all), each one's device time per batch;
and that they agree, on states with a zero layer, a NaN and an Inf planted.

    PYTHONPATH=src:benchmarks python3 benchmarks/state_checks_micro.py     # on a GPU (CUDA events)
"""

from __future__ import annotations

import time

import torch

from gpu_throughput import nonfinite_only
from hsextract.run.extract import ShardRun


def three_passes(batch, states: dict, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first form of issue 38's checks: the NaN/Inf flags, then row max, row min and the sum of squares."""
    bad_B, _ = nonfinite_only(batch, states, layers)
    rows_TLH = states["hidden_states"].reshape(states["hidden_states"].shape[0], layers, -1)
    top_TL, bottom_TL = rows_TLH.amax(-1), rows_TLH.amin(-1)
    constant_TL = top_TL == bottom_TL
    zero_TL = constant_TL & (top_TL == 0)
    squares_L = torch.linalg.vector_norm(rows_TLH, dim=(0, 2), dtype=torch.float32).square()
    return bad_B, torch.stack([squares_L, zero_TL.sum(0).float(), constant_TL.sum(0).float()], dim=1)


def per_batch_ms(fn, batch, states, layers: int, cuda: bool, reps: int = 50) -> float:
    for _ in range(3):
        fn(batch, states, layers)
    if not cuda:
        began = time.perf_counter()
        fn(batch, states, layers)
        return (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(batch, states, layers)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    layers, width, lengths = 5, 5120, [1024] * 8
    batch = [[0] * n for n in lengths]
    hidden = torch.randn(sum(lengths), layers * width, device=device, dtype=torch.bfloat16)
    hidden[:, width:2 * width] = 0  # layer 1 all zeros
    hidden[5, 7] = float("nan")  # sample 0
    hidden[3000, 4 * width + 9] = float("inf")  # sample 2
    states = {"hidden_states": hidden}
    (bad_a, stats_a), (bad_b, stats_b) = three_passes(batch, states, layers), ShardRun.check_states(batch, states, layers)
    agree = torch.equal(bad_a, bad_b) and torch.equal(stats_a[:, 1:], stats_b[:, 1:])
    print(f"flags {bad_b.tolist()}, zero rows per layer {stats_b[:, 1].tolist()}; three passes and check_states "
          f"agree: {agree}")
    for name, fn in (("before issue 38 (NaN/Inf flags)", nonfinite_only), ("flags + amax, amin, norm", three_passes),
                     ("check_states (aminmax, norm)", ShardRun.check_states)):
        print(f"{name}: {per_batch_ms(fn, batch, states, layers, cuda):.3f} ms per batch of {sum(lengths)} tokens x "
              f"{layers} layers x {width} on {device}")


if __name__ == "__main__":
    main()
