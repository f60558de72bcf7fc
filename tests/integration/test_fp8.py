"""`--out-dtype fp8_e4m3`: half the bytes of bf16, a bounded loss, the same records from the reader."""

from __future__ import annotations

import json

import torch

import hsextract
from hsextract.output.batchfile import BatchFile
from hsextract.output.quant import FP8_ENCODING, dequantize, quantize

from harness.worker import run_extract, summary_of


def test_quantize_round_trip_bounds_the_error_per_element():
    torch.manual_seed(0)
    states = torch.randn(64, 3 * 32) * torch.logspace(-3, 3, 64)[:, None]  # very different token scales
    q, scale = quantize(states, 32)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 3)
    back = dequantize(q, scale, torch.float32)
    per_layer_amax = states.view(64, 3, 32).abs().amax(-1, keepdim=True)
    err = ((back - states).view(64, 3, 32).abs() / per_layer_amax)
    assert err.max() <= 2 ** -4 + 1e-6  # e4m3: 3 mantissa bits, relative to each token-layer's amax


def test_fp8_output_is_smaller_and_close_to_the_lossless_one(tiny_model, dataset, tmp_path):
    full, fp8 = tmp_path / "full", tmp_path / "fp8"
    for out, extra in ((full, ()), (fp8, ("--out-dtype", "fp8_e4m3"))):
        proc = run_extract(tiny_model, dataset, out, 0, 1, "--dtype", "bfloat16", *extra)
        assert proc.returncode == 0, proc.stderr
    lossless = {s["id"]: s for s in hsextract.read_samples(full, verify=True)}
    lossy = {s["id"]: s for s in hsextract.read_samples(fp8, verify=True)}
    assert lossless.keys() == lossy.keys()
    errors = []
    for sample_id, ref in lossless.items():
        got = lossy[sample_id]
        assert got["hidden_states"].dtype == torch.bfloat16 and got["hidden_states"].shape == ref["hidden_states"].shape
        assert torch.equal(got["input_ids"], ref["input_ids"]) and torch.equal(got["loss_mask"], ref["loss_mask"])
        a, b = got["hidden_states"].double(), ref["hidden_states"].double()
        errors.append(((a - b).norm() / b.norm()).item())
    assert max(errors) < 0.05, max(errors)  # documented: ~2-3% RMS per sample
    size = lambda root: sum(p.stat().st_size for p in root.glob("shard-*/*.safetensors"))  # noqa: E731
    assert size(fp8) < 0.6 * size(full)
    first = BatchFile(next(fp8.glob("shard-*/*.safetensors")))
    assert first.metadata["hidden_states_encoding"] == FP8_ENCODING
    summary = summary_of(run_extract(tiny_model, dataset, fp8, 0, 1, "--dtype", "bfloat16", "--out-dtype",
                                     "fp8_e4m3"))  # the same recipe (float32, the CPU's auto, would be another)
    assert summary["samples_written"] == 0, "complete: nothing redone"
    print(f"\nfp8 vs bf16: median rel err {sorted(errors)[len(errors) // 2]:.4f}, max {max(errors):.4f}; "
          f"bytes {size(fp8) / size(full):.3f} of bf16")


def test_bad_out_dtype_is_refused_naming_it(tiny_model, dataset, tmp_path):
    proc = run_extract(tiny_model, dataset, tmp_path / "o", 0, 1, "--out-dtype", "int4")
    assert proc.returncode != 0 and "--out-dtype" in proc.stderr
    assert not json.dumps(proc.stdout).count("SUMMARY")
