"""The pinned sets are sized before the first batch: a full batch's states, whatever is stored, must fit one."""

from __future__ import annotations

import pytest
import torch

from hsextract.run.capture import LayerCapture
from hsextract.data.chat import Tokenized
from hsextract.run.extract import ShardRun
from hsextract.run.layers import parse_layer_spec
from hsextract.run.liveness import Progress
from hsextract.options import WorkerOptions
from hsextract.run.hostcopy import ALIGN, copier_plan
from hsextract.run.writer import BAD_KEY, STATS_KEY

BUDGET = 96


@pytest.mark.parametrize("out_dtype,include_last,dtype", [
    ("auto", False, torch.float32), ("auto", True, torch.bfloat16), ("fp8_e4m3", False, torch.float32),
    ("fp8_e4m3", True, torch.float32)])
def test_a_full_batch_of_states_fits_the_set_planned_from_bytes_per_token(tiny_model, tmp_path, out_dtype,
                                                                            include_last, dtype):
    opts = WorkerOptions(model=tiny_model, data=tmp_path / "d.jsonl", out=str(tmp_path / "out"), layers="dflash:3",
                         out_dtype=out_dtype, include_last=include_last, token_budget=BUDGET)
    layer_ids = parse_layer_spec("dflash:3", 8)
    capture = LayerCapture(tiny_model, layer_ids, include_last, "cpu", dtype)
    shard = ShardRun(opts, Progress(0, 1, "test"))
    per_token = shard.bytes_per_token(capture)
    sets, set_bytes = copier_plan(per_token, BUDGET, depth=5, max_bytes=1 << 30)
    assert sets == 5 and set_bytes >= BUDGET * per_token
    # the worst case a budget allows: many short samples (a flag each) up to the budget, and one long one
    for lengths in ([1] * BUDGET, [BUDGET // 4] * 4, [BUDGET]):
        batch = [Tokenized(f"s{i}", list(range(10, 10 + n)), [1] * n) for i, n in enumerate(lengths)]
        (part, states), = shard.forward(capture, batch)
        assert part == batch and BAD_KEY in states
        assert ("hidden_states_scale" in states) == (out_dtype == "fp8_e4m3")
        assert ("last_hidden_state" in states) == include_last
        raw = sum(t.numel() * t.element_size() for t in states.values())
        aligned = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in states.values())
        shapes = {k: (v.dtype, tuple(v.shape)) for k, v in states.items()}
        assert aligned <= set_bytes, (lengths, shapes, per_token)
        if len(lengths) == BUDGET:  # a flag per token: the plan is exact, not merely enough (but for the layers'
            stats = states[STATS_KEY]  # stats, a few numbers a batch, which the set's alignment slack holds)
            assert raw - stats.numel() * stats.element_size() == BUDGET * per_token, (shapes, per_token)


def test_the_sets_are_bounded_in_bytes_and_never_fewer_than_two():
    sets, set_bytes = copier_plan(51_201, 8192, depth=7, max_bytes=16 << 30)
    assert (sets, set_bytes) == (7, 8192 * 51_201 + 6 * ALIGN)
    assert copier_plan(51_201, 8192, depth=7, max_bytes=3 * set_bytes)[0] == 3  # the bound caps the count
    assert copier_plan(51_201, 8192, depth=7, max_bytes=set_bytes // 2)[0] == 2  # one filling, one written
    assert copier_plan(1, 10, depth=4)[0] == 4  # default bound: a share of this host's memory


def test_the_fla_convolution_is_used_only_where_it_can_run(tiny_model):
    """On CPU (and on a GPU host without fla) the modeling module keeps transformers' own convolution; the
    switch itself, and its states against the reference, are measured on the GPU (gpu_throughput.py,
    gpu_correctness.py)."""
    import importlib.util
    import sys

    from hsextract.run.kernels import CONV_NAME, use_fla_conv

    capture = LayerCapture(tiny_model, [1, 3], False, "cpu", torch.float32)
    owner = sys.modules[type(capture.backbone.layers[0].linear_attn).__module__]
    before = getattr(owner, CONV_NAME)
    assert capture.kernels == [] and use_fla_conv(capture.backbone, torch.device("cpu")) == []
    if importlib.util.find_spec("fla") is None:
        assert use_fla_conv(capture.backbone, torch.device("cuda")) == []
    assert getattr(owner, CONV_NAME) is before


def test_warm_up_runs_the_linear_attention_once_per_batch_size_a_run_can_meet(tiny_model):
    """The worker calls it on CUDA before the first batch (kernels that autotune per batch size tune then):
    every bucketed size up to budget // 16, random input within the budget, the hybrid's one GDN module type;
    then the masks' test batch (`settle_masks`, two forwards of the whole stack) at a shape it just warmed."""
    from hsextract.run.batching import batch_size_buckets

    capture = LayerCapture(tiny_model, [1, 3], False, "cpu", torch.float32)
    seen = []
    gdn = next(layer.linear_attn for layer in capture.backbone.layers if hasattr(layer, "linear_attn"))
    handle = gdn.register_forward_hook(
        lambda _m, args, kwargs, _out: seen.append(tuple((args[0] if args else kwargs["hidden_states"]).shape)),
        with_kwargs=True)
    try:
        sizes = capture.warm_up(512)
    finally:
        handle.remove()
    warmed, settled = seen[:len(sizes)], seen[len(sizes):]
    assert sizes == batch_size_buckets(32) and [b for b, _, _ in warmed] == sizes  # one module: the first
    assert all(b * t <= 512 and h == capture.hidden_size for b, t, h in warmed)
    assert settled == [(2, 64, capture.hidden_size)] * 2 and (2, 64, capture.hidden_size) in warmed
    assert capture.masks == {"full_attention": None, "linear_attention": None}
