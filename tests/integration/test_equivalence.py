"""Packed, padded batches give every sample exactly the states it gets alone (the batch>1 bug class)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hsextract
from hsextract import tiny
from hsextract.output.batchfile import BatchFile

from harness.worker import dataset_ids, run_extract, summary_of

LAYERS = [1, 3, 6]


def reference_states(model_dir, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The sample alone through the full model with output_hidden_states (the contract's definition)."""
    model = reference_states.cache.get(model_dir)
    if model is None:
        model = reference_states.cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        out = model(input_ids=input_ids.long()[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.hidden_states[-1][0]


reference_states.cache = {}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def assert_matches_reference(model_dir, out_dir, layers, expect_ids):
    samples = list(hsextract.read_samples(out_dir))
    assert sorted(s["id"] for s in samples) == sorted(expect_ids)
    hidden = BatchFile(next(out_dir.glob("shard-*/batch-*.safetensors"))).metadata["hidden_size"]
    worst = 0.0
    for sample in samples:
        per_layer, _ = reference_states(model_dir, sample["input_ids"])
        got = sample["hidden_states"]
        assert got.shape == (len(sample["input_ids"]), len(layers) * int(hidden))
        for slot, layer_id in enumerate(layers):
            want = per_layer[layer_id + 1]
            err = relative_error(got[:, slot * int(hidden):(slot + 1) * int(hidden)], want)
            worst = max(worst, err)
            assert err < 1e-5, f"sample {sample['id']} layer {layer_id}: relative error {err:.2e}"
    return worst


def test_hybrid_packed_states_equal_per_sample_reference(tiny_model, dataset, tmp_path):
    out = tmp_path / "out"
    proc = run_extract(tiny_model, dataset, out, 0, 1, "--token-budget", "1200", "--include-last", layers="1,3,6")
    assert proc.returncode == 0, proc.stderr
    assert "attention masks made once: no host sync per batch" in proc.stderr
    summary = summary_of(proc)
    assert summary["files"] < summary["samples_done"] / 3, "batches should hold several samples"
    # batches really mix lengths (padding was exercised), and no file has one sample per file
    mixed = 0
    for path in out.glob("shard-*/batch-*.safetensors"):
        lengths = torch.tensor(BatchFile(path).cu_seqlens).diff()
        mixed += int(len(lengths) > 1 and lengths.min() < lengths.max())
    assert mixed >= 2
    assert_matches_reference(tiny_model, out, LAYERS, dataset_ids(dataset))
    for sample in hsextract.read_samples(out):
        _, last = reference_states(tiny_model, sample["input_ids"])
        assert relative_error(sample["last_hidden_state"], last) < 1e-5


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5"])
def test_other_architectures_match_reference(kind, tmp_path):
    model_dir = tiny.build_model(tmp_path / kind, kind=kind, num_layers=6)
    data = tiny.build_dataset(tmp_path / "data.jsonl", 24, seed=3)
    out = tmp_path / "out"
    proc = run_extract(model_dir, data, out, 0, 1, "--token-budget", "800", layers="1,3")
    assert proc.returncode == 0, proc.stderr
    # Llama's config names no layer kinds: it makes its masks per batch, as transformers does
    assert ("attention masks made once" in proc.stderr) == (kind != "llama")
    assert_matches_reference(model_dir, out, [1, 3], dataset_ids(data))


def test_metadata_and_schema(tiny_model, dataset, tmp_path):
    out = tmp_path / "out"
    proc = run_extract(tiny_model, dataset, out, 0, 3, layers="dflash:3")
    assert proc.returncode == 0, proc.stderr
    path = sorted(out.glob("shard-00000-of-00003/batch-*.safetensors"))[0]
    batch = BatchFile(path)
    meta = batch.metadata
    assert json.loads(meta["layer_ids"]) == [1, 3, 5]  # dflash:3 on 8 layers: 1..L-3 evenly
    assert meta["model"] == tiny_model.name and meta["hidden_size"] == "64" and meta["format_version"] == "1"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tokens = handle.get_tensor("input_ids").shape[0]
        assert handle.get_tensor("hidden_states").shape == (tokens, 3 * 64)
        assert handle.get_tensor("input_ids").dtype == torch.int32
        assert set(handle.get_tensor("loss_mask").unique().tolist()) <= {0, 1}
        cu = handle.get_tensor("cu_seqlens")
        assert cu.dtype == torch.int64 and cu[0] == 0 and cu[-1] == tokens and len(cu) == len(batch) + 1


def test_masks_made_once_give_the_models_own_states(tiny_model):
    """The worker's forward passes the hybrid's masks made once (no host sync per batch): a padded batch's
    states are bit-identical to the model's own masks'; an eager-attention model, which needs a real causal
    mask, keeps making its own."""
    from hsextract.run.capture import LayerCapture, _masks_made_once

    capture = LayerCapture(tiny_model, [1, 3], False, "cpu", torch.float32)
    assert capture.settle_masks() and capture.masks == {"full_attention": None, "linear_attention": None}
    generator = torch.Generator().manual_seed(5)
    samples = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (40, 25, 33)]  # padded batch
    made_once = capture.run(samples)["hidden_states"]
    masks, capture.masks = capture.masks, None  # the model makes its own
    own = capture.run(samples)["hidden_states"]
    assert made_once.shape == (98, 2 * 64) and torch.equal(own, made_once)
    capture.masks = masks
    ids_BT = torch.tensor([samples[0][:8]] * 2)

    eager = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    with torch.inference_mode():
        causal = eager.model(input_ids=ids_BT[:, :8], use_cache=False).last_hidden_state
        unmasked = eager.model(input_ids=ids_BT[:, :8], attention_mask=capture.masks, use_cache=False).last_hidden_state
    assert not torch.equal(causal, unmasked)  # eager attention without its mask sees the future
    assert _masks_made_once(eager.model, eager.config, 512, torch.device("cpu")) is None
