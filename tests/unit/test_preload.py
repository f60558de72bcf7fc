"""The weights read beside the imports (hsextract.run.preload): real safetensors files, a real thread, real models.

On CPU the thread reads straight into the tensors (a GPU's pinned staging and copies are run by
benchmarks/gpu_correctness.py, which also checks the states equal those of a load from the files, and timed by
benchmarks/model_load.py). Here: exactly the tensors the load needs, byte for byte; a model built around them equal
to one transformers loads from the files, for every model family the tests build; the cases where the load should
read the files itself; a stop; a file that does not read, left to the load."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from hsextract import tiny
from hsextract.run.capture import LayerCapture
from hsextract.run.preload import Preload, plan, start_preload, why_not
from hsextract.run.readahead import ReadAhead, weight_files

NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.weight", "model.layers.1.mlp.weight",
         "model.layers.2.mlp.weight", "mtp.layers.0.mlp.weight", "model.norm.weight", "lm_head.weight"]


def checkpoint(path, names, dtype=torch.bfloat16, scalar=False):
    torch.manual_seed(0)
    tensors = {name: torch.randn(3 + i, 5, dtype=torch.float32).to(dtype) for i, name in enumerate(names)}
    if scalar:
        tensors["model.layers.0.scalar"] = torch.tensor(7, dtype=torch.int64)  # a 0-d tensor of another dtype
    save_file(tensors, str(path))
    return tensors


def test_it_reads_exactly_the_tensors_the_load_needs(tmp_path):
    one, two = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    written = {**checkpoint(one, NAMES[:3], scalar=True), **checkpoint(two, NAMES[3:])}
    (tmp_path / "config.json").write_text("{}")
    preload = Preload(plan([one, two], keep_layers=2), torch.device("cpu"), chunk=16).start()  # many chunks a tensor
    got = preload.tensors()
    # layer 2, the MTP head and lm_head are not read (the worker drops lm_head: transformers makes one, unread)
    assert sorted(got) == sorted(["model.embed_tokens.weight", "model.layers.0.mlp.weight",
                                  "model.layers.1.mlp.weight", "model.norm.weight", "model.layers.0.scalar"])
    for name, tensor in got.items():
        assert tensor.dtype == written[name].dtype and torch.equal(tensor, written[name]), name
    summary = preload.summary()
    assert summary["used"] is True and summary["bytes"] == summary["planned_bytes"] == sum(
        t.numel() * t.element_size() for t in got.values()) and summary["tensors"] == 5
    assert summary["done_at"] > 0 and "error" not in summary and "stopped" not in summary
    assert preload.tensors() is None  # handed over once


def test_the_gpu_s_way_through_staging_buffers_lands_every_byte_and_checks_the_copies(tmp_path):
    """The staged path the GPU takes (two staging buffers in turn, copies, the copies' ends read back), run on
    CPU: chunks smaller than tensors and tensors smaller than chunks give the same bytes; a copy lost, or one
    that read a buffer already refilled, is caught and named."""
    one, two = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    written = {**checkpoint(one, NAMES[:3], scalar=True), **checkpoint(two, NAMES[3:])}
    for chunk in (7, 64, 1 << 20):
        preload = Preload(plan([one, two], keep_layers=2), torch.device("cpu"), chunk=chunk, staged=True).start()
        got = preload.tensors()
        assert got is not None, preload.summary()
        assert all(torch.equal(t, written[name]) for name, t in got.items()) and len(got) == 5
        assert preload.bytes_read == preload.planned  # its two readers took each file once

    class Lost(Preload):  # the copies into one tensor never land
        def _copy(self, dest, src):
            if dest.data_ptr() != self._victim:
                super()._copy(dest, src)

    lost = Lost(plan([one, two], keep_layers=2), torch.device("cpu"), chunk=16, staged=True)
    lost._victim = None
    real_alloc = lost._alloc

    def alloc(entry):
        raw = real_alloc(entry)
        if entry.name == "model.layers.1.mlp.weight":
            lost._victim = raw.data_ptr()
        return raw

    lost._alloc = alloc
    assert lost.start().tensors() is None
    assert "tensor 'model.layers.1.mlp.weight' on the cpu does not hold the bytes read from the file at its byte 0" \
        in lost.summary()["error"], lost.summary()

    class Stale(Preload):  # every copy reads its staging buffer after the next read refilled it
        def _copy(self, dest, src):
            self._pending = getattr(self, "_pending", [])
            self._pending.append((dest, src))
            if len(self._pending) > 2:
                d, s = self._pending.pop(0)
                d.copy_(s)

        def _check(self, *args):  # the last copies land (late) before the check: only the stale ones are wrong
            for d, s in self._pending:
                d.copy_(s)
            self._pending = []
            super()._check(*args)

    stale = Stale(plan([one, two], keep_layers=2), torch.device("cpu"), chunk=16, staged=True).start()
    assert stale.tensors() is None and "does not hold the bytes read from the file" in stale.summary()["error"]


def test_the_files_are_read_by_the_load_itself_where_a_preload_would_cost_or_break(tmp_path):
    path = tmp_path / "model.safetensors"
    checkpoint(path, NAMES, dtype=torch.float32)
    (tmp_path / "config.json").write_text("{}")
    files = plan([path], None)
    assert why_not(tmp_path, files, torch.float32) is None
    assert "100% of its bytes are not bfloat16" in why_not(tmp_path, files, torch.bfloat16)  # all converted: twice
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"quantization_config": {"quant_method": "fp8"}}}))
    assert "quantized" in why_not(tmp_path, files, torch.float32)
    (tmp_path / "config.json").write_text("{}")
    assert start_preload(tmp_path / "nowhere", None, "cpu", torch.float32) == (None, "no safetensors files")
    bad = tmp_path / "bad" / "model.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(b"\x09\x00\x00\x00\x00\x00\x00\x00{not json")
    preload, why = start_preload(bad.parent, None, "cpu", torch.float32)
    assert preload is None and why.startswith("JSONDecodeError"), why
    odd = tmp_path / "odd" / "model.safetensors"
    odd.parent.mkdir()
    header = json.dumps({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    odd.write_bytes(len(header).to_bytes(8, "little") + header + b"\x00")
    with pytest.raises(ValueError, match="tensor 'w': dtype 'F4'"):
        plan([odd], None)


def test_a_stop_drops_what_it_read_and_a_short_file_is_an_error_not_a_raise(tmp_path):
    path = tmp_path / "model.safetensors"
    checkpoint(path, NAMES)
    told = Preload(plan([path], None), torch.device("cpu"))
    told._stop.set()  # told before its first read (the worker failed first)
    told.start()
    assert told.tensors() is None and told.summary()["stopped"] is True and told.summary()["used"] is False
    (_, entries), = files = plan([path], None)
    with path.open("r+b") as f:
        f.truncate(max(e.end for e in entries) - 10)  # cut after its plan: a tensor it reads ends short
    short = Preload(files, torch.device("cpu")).start()
    assert short.tensors() is None and "ends inside tensor" in short.summary()["error"], short.summary()
    with pytest.raises(ValueError, match="past the file's end"):  # cut before: the plan says so
        plan([path], None)


def test_it_reads_only_what_the_read_ahead_has_read_and_a_stop_ends_its_wait(tmp_path):
    """One reader on the disk: the preload reads a chunk once the read-ahead of the same files has read it. Here
    the read-ahead is held after its first file: the preload reads all of that file, none of the second, and goes
    on when the read-ahead does; the staged path (the GPU's) and the direct one alike."""
    one, two = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    written = {**checkpoint(one, NAMES[:3]), **checkpoint(two, NAMES[3:])}

    class Held(ReadAhead):  # the real reader, held before its second file until `gate` opens
        gate = threading.Event()

        def _move(self, index, offset):
            super()._move(index, offset)
            if index == 1:
                self.gate.wait()

    files = plan([one, two], keep_layers=2)
    first_file = sum(e.end - e.begin for e in files[0][1])
    for staged in (False, True):
        Held.gate.clear()
        ahead = Held([one, two], 2, limit_bytes=1 << 30).start()
        preload = Preload(files, torch.device("cpu"), chunk=16, staged=staged, follow=ahead).start()
        deadline = time.monotonic() + 10
        while preload.bytes_read < first_file and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time enough to run ahead, were it not held
        assert preload.bytes_read == first_file and preload._thread.is_alive(), (staged, preload.summary())
        Held.gate.set()
        got = preload.tensors()
        ahead.stop()
        assert got is not None and sorted(got) == sorted(["model.embed_tokens.weight", "model.layers.0.mlp.weight",
                                                          "model.layers.1.mlp.weight", "model.norm.weight"])
        assert all(torch.equal(t, written[name]) for name, t in got.items())
        assert preload.summary()["waited_s"] >= 0.2 and ahead.covered(two, 1 << 40)  # ended: all covered

    Held.gate.clear()  # a stop while it waits for the read-ahead ends the wait
    ahead = Held([one, two], 2, limit_bytes=1 << 30).start()
    preload = Preload(files, torch.device("cpu"), follow=ahead).start()
    time.sleep(0.2)
    began = time.monotonic()
    preload.stop()
    assert time.monotonic() - began < 2 and preload.summary()["stopped"] is True
    Held.gate.set()
    ahead.stop()
    unstarted = ReadAhead([one], 2, limit_bytes=1 << 30)
    assert unstarted.covered(one, 1 << 40, 0) and ahead.covered(tmp_path / "elsewhere.safetensors", 1, 0)


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5", "llama", "qwen3"])
def test_a_model_built_around_the_preloaded_tensors_equals_transformers_load_from_the_files(kind, tmp_path):
    model_dir = tiny.build_model(tmp_path / kind, kind=kind, num_layers=4)
    files = load_file(str(weight_files(model_dir)[0]))
    layer_ids = [0, 2]
    from_files = LayerCapture(model_dir, layer_ids, False, "cpu", torch.float32)
    preload, why = start_preload(model_dir, 3, "cpu", torch.float32)
    assert why is None
    preloaded = LayerCapture(model_dir, layer_ids, False, "cpu", torch.float32, preload=preload)
    assert from_files.load_path == "through host memory"
    assert preloaded.load_path == "read to the device beside the imports" and preload.taken
    a, b = from_files.backbone.state_dict(), preloaded.backbone.state_dict()
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    # the weights are the checkpoint's: layer 3 was neither read nor made, lm_head not read
    assert len(preloaded.backbone.layers) == 3 and not any("lm_head" in k for k in a)
    assert sum(t.numel() * t.element_size() for k, t in files.items()
               if ".layers.3." not in k and not k.startswith("lm_head.")) == preload.summary()["bytes"]
    batch = [[5, 6, 7, 8, 9], [10, 11, 12]]
    got, want = preloaded.run(batch), from_files.run(batch)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
