"""The checkpoint's read-ahead (hsextract.run.readahead): real safetensors files, a real thread reading them.

What it gains on a GPU host (the load finding its weights in the page cache) is measured in
benchmarks/model_load.py; here: it reads exactly the tensors a load of the kept layers needs, stops when told
or at its limit, and a file it cannot read is left to the load, never raised."""

from __future__ import annotations

import collections
import ctypes
import json
import mmap
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from hsextract.errors import UsageError
from hsextract.options import WorkerOptions
from hsextract.run.readahead import (CHUNK, GAP, READER_SWITCH_S, ReadAhead, needed_ranges, start_read_ahead,
                                 weight_files)

MIB2 = 2 << 20  # each tensor: 2 MiB of one byte value, so the bytes read say which tensors were read


def checkpoint(path, names):
    """A safetensors file whose tensor i (of `names`) is 2 MiB of the byte value i + 1."""
    save_file({name: torch.full((MIB2,), i + 1, dtype=torch.uint8) for i, name in enumerate(names)}, str(path))
    return {name: i + 1 for i, name in enumerate(names)}


def bytes_in(path, ranges):
    counts = collections.Counter()
    with path.open("rb") as f:
        for begin, end in ranges:
            f.seek(begin)
            counts.update(f.read(end - begin))
    return counts


NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.weight", "model.layers.1.mlp.weight",
         "model.layers.2.mlp.weight", "model.language_model.layers.3.mlp.weight", "mtp.layers.0.mlp.weight",
         "model.norm.weight", "lm_head.weight"]


def test_it_reads_the_tensors_of_the_kept_layers_and_skips_the_rest(tmp_path):
    path = tmp_path / "model.safetensors"
    value = checkpoint(path, NAMES)
    kept = bytes_in(path, needed_ranges(path, keep_layers=2))
    wanted = {"model.embed_tokens.weight", "model.layers.0.mlp.weight", "model.layers.1.mlp.weight",
              "model.norm.weight"}
    for name in NAMES:  # every byte of a wanted tensor, none of the others (layers 2 and 3, the MTP head, lm_head)
        assert kept[value[name]] == (MIB2 if name in wanted else 0), name
    every = bytes_in(path, needed_ranges(path, keep_layers=None))  # --include-last: every layer, still no MTP
    assert [every[value[n]] for n in NAMES] == [MIB2] * 5 + [0, MIB2, 0]


def test_the_files_are_the_index_s_else_every_safetensors_file(tmp_path):
    for name in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors", "extra.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in weight_files(tmp_path)] == ["extra.safetensors", "model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    assert [p.name for p in weight_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]


def test_the_thread_reads_what_the_load_needs_up_to_its_limit(tmp_path):
    one, two = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    checkpoint(one, NAMES[:4])
    checkpoint(two, NAMES[4:])
    before = sys.getswitchinterval()
    ahead = ReadAhead([one, two], 2, limit_bytes=1 << 40).start()
    assert sys.getswitchinterval() == min(before, READER_SWITCH_S)  # a reader waits little for the imports' lock
    assert ahead.wait(60)
    ahead.stop()  # after the end: changes nothing but the switch interval, back as it was
    assert sys.getswitchinterval() == before
    summary = ahead.summary()
    assert summary["bytes"] == summary["planned_bytes"] == 4 * MIB2, summary  # embed, layers 0-1, norm
    assert summary["done_at"] > 0 and "error" not in summary
    capped = ReadAhead([one, two], 2, limit_bytes=MIB2 + 1).start()
    assert capped.wait(60)
    assert MIB2 + 1 <= capped.bytes_read <= MIB2 + 1 + CHUNK and capped.bytes_read < 4 * MIB2
    capped.stop()
    assert "stopped" not in capped.summary()  # it read its limit: not stopped
    told = ReadAhead([one, two], 2, limit_bytes=1 << 40)
    told._stop.set()  # told to stop before its first read (the load was done first)
    told.start().wait(60)
    told.stop()
    assert told.bytes_read == 0 and told.summary()["stopped"] is True


def resident(path, begin, end):
    """The share of the pages of `path`'s bytes `begin`..`end` in the page cache (mincore of a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: untouched pages are the cache's
    try:
        first = begin // mmap.PAGESIZE * mmap.PAGESIZE
        pages = (end - first + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        flags = (ctypes.c_ubyte * pages)()
        at = ctypes.c_char.from_buffer(mapped, first)
        assert libc.mincore(ctypes.c_void_p(ctypes.addressof(at)), ctypes.c_size_t(end - first), flags) == 0, \
            os.strerror(ctypes.get_errno())
        del at
        return sum(flag & 1 for flag in flags) / pages
    finally:
        mapped.close()


def evict(path):
    with path.open("rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_what_it_reads_lands_in_the_page_cache_without_a_copy_and_with_one(tmp_path, monkeypatch):
    """The read-ahead's point: the load's bytes in the page cache. Sent to /dev/null (no copy into the worker,
    `zero_copy`), and read into a buffer where the system cannot send a file."""
    path = tmp_path / "model.safetensors"
    checkpoint(path, NAMES)
    ranges = needed_ranges(path, 2)
    evict(path)
    if max(resident(path, b, e) for b, e in ranges) > 0.5:
        pytest.skip(f"this file system keeps {path}'s pages in memory whatever it is told: nothing to measure")
    ahead = ReadAhead([path], 2, limit_bytes=1 << 40).start()
    assert ahead.wait(60)
    ahead.stop()
    assert ahead.summary()["zero_copy"] is True and ahead.bytes_read == 4 * MIB2, ahead.summary()
    assert [resident(path, b, e) for b, e in ranges] == [1.0] * len(ranges)

    def refused(*args):
        raise OSError(22, "Invalid argument")

    evict(path)
    monkeypatch.setattr(os, "sendfile", refused)  # a system that cannot send a file to /dev/null
    ahead = ReadAhead([path], 2, limit_bytes=1 << 40).start()
    assert ahead.wait(60)
    ahead.stop()
    summary = ahead.summary()
    assert summary["zero_copy"] is False and summary["bytes"] == 4 * MIB2 and "error" not in summary, summary
    assert [resident(path, b, e) for b, e in ranges] == [1.0] * len(ranges)


def test_a_file_it_cannot_parse_is_recorded_not_raised(tmp_path):
    good, bad = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    checkpoint(good, NAMES[:1])
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    ahead = ReadAhead([good, bad, tmp_path / "missing.safetensors"], None, 1 << 40).start()
    assert ahead.wait(60)
    ahead.stop()
    assert ahead.bytes_read == MIB2 and ahead.error.startswith(("JSONDecodeError", "ValueError")), ahead.error
    huge = tmp_path / "c.safetensors"  # a header length no file holds: refused before any allocation
    huge.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="more than the file holds"):
        needed_ranges(huge, None)


def test_start_reads_a_real_checkpoint_unless_told_not_to(tiny_model, tmp_path):
    def opts(**kw):
        return WorkerOptions(**{"model": tiny_model, "data": tmp_path / "d.jsonl", "out": str(tmp_path / "o"),
                                "layers": "1,3", **kw})

    path, = tiny_model.glob("*.safetensors")

    def span(keep, gap=0):
        return sum(end - begin for begin, end in needed_ranges(path, keep, gap))

    assert span(4) < span(None) < path.stat().st_size  # layers 4-7 of 8 are not needed for layers 1 and 3
    ahead = start_read_ahead(opts())
    assert ahead.wait(60)
    assert ahead.keep_layers == 4 and ahead.limit > 0 and 0 < ahead.bytes_read == ahead.planned == span(4, GAP)
    everything = start_read_ahead(opts(include_last=True))
    assert everything.wait(60)
    assert everything.keep_layers == 8 and everything.planned == span(None, GAP)
    ahead.stop(), everything.stop()
    assert start_read_ahead(opts(read_ahead_gb=0)) is None
    assert start_read_ahead(opts(random_weights=3)) is None and start_read_ahead(opts(synthetic=100.0)) is None
    assert start_read_ahead(opts(layers="99")) is None  # the worker's own check names the bad layer, not this
    small = start_read_ahead(opts(read_ahead_gb=1e-6))  # 1000 bytes: one chunk at most
    assert small.wait(60)
    assert small.limit == 1000 and small.bytes_read <= CHUNK
    small.stop()


def test_a_negative_size_is_refused_naming_the_option(tmp_path):
    opts = WorkerOptions(model=tmp_path, data=tmp_path / "d.jsonl", out=str(tmp_path / "o"), layers="1",
                         read_ahead_gb=-1.0)
    with pytest.raises(UsageError, match=r"--read-ahead-gb -1: must be 0 \(off\) or more"):
        opts.check()
