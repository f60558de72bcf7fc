"""The batch file writer lays out safetensors itself (no serialized copy of the states): same bytes."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from hsextract.output.batchfile import DTYPE_NAMES, build_payload, write_batch
from hsextract.output.payload import write_unsealed


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(DTYPE_NAMES):
        x = torch.randn(3, 5, generator=g) * 10
        tensors[f"t{i}"] = x > 0 if dtype == torch.bool else x.to(dtype)
    tensors["a_late_bf16"] = torch.randn(4, 2, generator=g).to(torch.bfloat16)  # ties sort by name
    tensors["empty"] = torch.zeros(0, 7, dtype=torch.int32)
    tensors["strided"] = torch.arange(24, dtype=torch.int64).reshape(4, 6)[:, ::2]  # not contiguous
    return tensors


def test_payload_is_laid_out_as_safetensors_save_lays_it_out():
    """Same header (as JSON: safetensors orders metadata keys by a hash map, so its bytes vary run to run),
    same header length, same data bytes at the same offsets."""
    import json

    import xxhash

    tensors = every_dtype()
    payload = build_payload(tensors, {})
    ours = payload.tobytes()
    assert payload.size == len(ours)
    assert payload.sha256 == hashlib.sha256(ours).hexdigest() and payload.xxh3 == xxhash.xxh3_128(ours).hexdigest()
    ours_len = int.from_bytes(ours[:8], "little")
    header = json.loads(ours[8 : 8 + ours_len])
    metadata = header["__metadata__"]
    assert set(metadata) == {"format_version", "data_xxh3"}
    ref = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    ref_len = int.from_bytes(ref[:8], "little")
    assert ours_len == ref_len and len(ours) == len(ref)
    assert header == json.loads(ref[8 : 8 + ref_len])
    data = ours[8 + ours_len :]
    assert data == ref[8 + ref_len :]
    assert metadata["data_xxh3"] == xxhash.xxh3_128(data).hexdigest()  # the file carries its data's checksum


def test_written_file_reads_back_with_safetensors(tmp_path):
    tensors = every_dtype()
    meta = {"sample_ids": '["a", "b\\u00e9"]', "model": "m é", "layer_ids": "[1, 2]"}
    written = write_batch(tmp_path / "b.safetensors", tensors, meta)
    data = (tmp_path / "b.safetensors").read_bytes()
    assert written.bytes == len(data) and written.sha256 == hashlib.sha256(data).hexdigest()
    with safe_open(str(tmp_path / "b.safetensors"), framework="pt") as handle:
        found = handle.metadata()
        assert found == {"format_version": "1", **meta, "data_xxh3": found["data_xxh3"]}
        assert set(handle.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor), name
    assert not list(tmp_path.glob(".*.tmp"))


def test_refuses_a_tensor_it_cannot_lay_out():
    with pytest.raises(ValueError, match="'c'.*complex64"):
        build_payload({"c": torch.zeros(2, dtype=torch.complex64)}, {})


def test_unsealed_file_is_not_in_place_until_sealed(tmp_path):
    unsealed = write_unsealed(tmp_path / "b.safetensors", build_payload({"x": torch.ones(3)}, {}))
    assert not (tmp_path / "b.safetensors").exists() and (tmp_path / ".b.safetensors.tmp").exists()
    written = unsealed.seal()
    assert (tmp_path / "b.safetensors").stat().st_size == written.bytes
    assert not (tmp_path / ".b.safetensors.tmp").exists()
    dropped = write_unsealed(tmp_path / "c.safetensors", build_payload({"x": torch.ones(3)}, {}))
    dropped.abandon()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.safetensors"]


def test_views_of_a_downloaded_batch_equal_safetensors_load_without_copying():
    from hsextract.output.batchfile import LoadedBatch

    tensors = {**every_dtype(), "cu_seqlens": torch.tensor([0, 3], dtype=torch.int64)}
    data = bytearray(build_payload(tensors, {"sample_ids": '["a"]'}).tobytes())
    copied, viewed = LoadedBatch(data, "mem"), LoadedBatch(data, "mem", copy=False)
    assert copied.tensors.keys() == viewed.tensors.keys() == tensors.keys()
    for name, tensor in copied.tensors.items():
        got = viewed.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
    data[-1] ^= 0xFF  # the last byte of the last tensor laid out: only the views see it change
    assert sum(not torch.equal(viewed.tensors[k], t) for k, t in copied.tensors.items()) == 1, "views of data"


def test_a_mapped_file_and_shared_memory_give_views_of_one_storage(tmp_path):
    from hsextract.output.batchfile import LoadedBatch, shared_memory

    tensors = {**every_dtype(), "cu_seqlens": torch.tensor([0, 3], dtype=torch.int64)}
    path = tmp_path / "b.safetensors"
    write_batch(path, tensors, {"sample_ids": '["a"]'})
    before = path.read_bytes()
    mapped = LoadedBatch.mapped(path)
    data = shared_memory(len(before))
    data.copy_(torch.frombuffer(bytearray(before), dtype=torch.uint8))
    held = LoadedBatch(data, "shm", copy=False)
    for batch in (mapped, held):
        for name, tensor in tensors.items():
            got = batch.tensors[name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
            assert got.untyped_storage().data_ptr() == batch.data.untyped_storage().data_ptr(), "a view, no copy"
    assert held.tensors["cu_seqlens"].untyped_storage().is_shared()
    mapped.tensors["cu_seqlens"][0] = 7  # copy-on-write: the file is not changed
    assert path.read_bytes() == before


def test_the_torch_free_layout_makes_the_same_file_from_raw_bytes():
    """The synthetic worker (no torch) lays files out from buffers: byte for byte the file torch's path makes."""
    from hsextract.output.payload import TensorBytes, layout

    tensors = every_dtype()
    want = build_payload(tensors, {"k": "v"})
    entries = [TensorBytes(name, DTYPE_NAMES[t.dtype], tuple(t.shape), bytes(t.contiguous().reshape(-1).view(torch.uint8)
                                                                        .numpy()))
               for name, t in tensors.items()]
    got = layout(entries, {"k": "v"})
    assert got.sha256 == want.sha256 and got.size == want.size
    assert b"".join(bytes(p) for p in got.parts) == b"".join(bytes(p) for p in want.parts)
    with pytest.raises(ValueError, match=r"tensor 'x': 6 bytes for BF16 \[2, 2\]"):
        layout([TensorBytes("x", "BF16", (2, 2), b"\0" * 6)], {})
