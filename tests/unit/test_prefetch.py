"""Which weight files a run reads ahead, and that it reads none it could not keep in memory."""

from __future__ import annotations

import json

from hsextract.prefetch import WeightPrefetch, available_memory, files_to_load


def test_only_the_files_of_the_layers_a_run_loads_are_read_ahead(tmp_path):
    weight_map = {"model.embed_tokens.weight": "a.safetensors", "model.layers.0.mlp.weight": "a.safetensors",
                  "model.layers.1.mlp.weight": "b.safetensors", "model.layers.12.mlp.weight": "c.safetensors",
                  "model.norm.weight": "d.safetensors", "lm_head.weight": "d.safetensors"}
    for name in "abcd":
        (tmp_path / f"{name}.safetensors").write_bytes(name.encode() * 1000)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    names = [p.name for p in files_to_load(tmp_path, keep_layers=2)]  # layers 0, 1 (not 12) and no-layer tensors
    assert names == ["a.safetensors", "b.safetensors", "d.safetensors"]
    assert len(files_to_load(tmp_path, keep_layers=13)) == 4
    prefetch = WeightPrefetch(files_to_load(tmp_path, keep_layers=2))
    prefetch.start()
    prefetch.join(10)
    assert not prefetch.skipped and prefetch.read_bytes == prefetch.total == 3000
    assert prefetch.report().startswith("0.00 of 0.00 GB in 3 file(s) read ahead (done")
    (tmp_path / "model.safetensors.index.json").write_text("{not json")  # no usable index: every file
    assert len(files_to_load(tmp_path, keep_layers=2)) == 4


def test_weights_larger_than_half_the_free_memory_are_not_read_ahead(tmp_path):
    free = available_memory()
    assert free
    huge = tmp_path / "model.safetensors"
    with huge.open("wb") as handle:  # sparse: its size, not its blocks
        handle.truncate(free)
    prefetch = WeightPrefetch([huge])
    prefetch.start()
    prefetch.join(10)
    assert prefetch.read_bytes == 0 and "not read ahead" in prefetch.skipped and prefetch.report() == prefetch.skipped
