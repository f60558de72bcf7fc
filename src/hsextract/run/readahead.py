"""Read a checkpoint's weights into the page cache on a thread from the worker's start (no torch here).

The model's load begins only once torch, transformers and CUDA have started and the tokenizer and the dataset
are read: seconds in which the disk would sit idle. `ReadAhead` reads, meanwhile, the byte ranges of the
safetensors files that the load will ask for (every tensor but those of layers past the last one the worker
runs, of the multi-token-prediction head, which no load reads, and lm_head, which the worker drops), in file
order, so that the load finds them in memory or catches up with a read already under way. It sends them to
/dev/null: into the page cache, through no buffer of the worker's. `preload.Preload`, which reads the same
ranges straight to the device once torch is imported, follows it (`covered`): one reader on the disk, in order,
not two racing for the same bytes. The page cache is the host's: the workers of one host read one checkpoint's
pages once between them. It reads no more than half the memory the host has available (or `--read-ahead-gb`):
beyond that it would evict its own first pages before the load reads them. A file it cannot read or parse is
left to the load, which says what is wrong with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import sys
import threading
import time
from pathlib import Path

from hsextract.data.model import read_model_info
from hsextract.options import WorkerOptions
from hsextract.run.layers import layers_to_load, parse_layer_spec
from hsextract.run.liveness import PROCESS_START

#: bytes per read: large enough to keep the disk busy and to need the interpreter's lock seldom (each read
#: returns to Python, and waits for the lock the imports hold), small enough that a stop is quick
CHUNK = 64 << 20
#: the interpreter's switch interval while the readers run beside the imports (Python's default is 5 ms): a
#: reader whose read returned waits at most this long for the lock
READER_SWITCH_S = 0.001
#: tensors this close together are read as one range (their headers and alignment between them)
GAP = 1 << 20
#: a tensor of decoder layer N: `model.layers.N.` or `model.language_model.layers.N.`
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every `*.safetensors` there."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    return sorted(model_dir.glob("*.safetensors"))


def read_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's data offset (8 + header length) and header; OSError/ValueError if `path` is not a
    readable safetensors file."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"{path}: its header says {length} bytes, more than the file holds")
        return 8 + length, json.loads(f.read(length))


def loaded(name: str, keep_layers: int | None) -> bool:
    """Whether the worker's load reads tensor `name`: not a layer past the first `keep_layers` (None: all), not
    the multi-token-prediction head, not lm_head (the worker drops it; made, not read, where it is left out)."""
    if name == "__metadata__" or name.startswith(("mtp.", "lm_head.")):
        return False
    layer = LAYER.search(name)
    return keep_layers is None or not layer or int(layer.group(1)) < keep_layers


def needed_ranges(path: Path, keep_layers: int | None, gap: int = GAP) -> list[tuple[int, int]]:
    """The byte ranges of `path` holding the tensors a load of the first `keep_layers` decoder layers reads
    (None: every layer; `loaded`), merged where at most `gap` bytes apart, in file order. OSError/ValueError if
    `path` is not a readable safetensors file."""
    base, header = read_header(path)
    spans = sorted((base + meta["data_offsets"][0], base + meta["data_offsets"][1])
                   for name, meta in header.items() if loaded(name, keep_layers))
    return merge(spans, gap)


def merge(spans: list[tuple[int, int]], gap: int = GAP) -> list[tuple[int, int]]:
    """Sorted byte ranges merged where at most `gap` bytes apart."""
    merged: list[tuple[int, int]] = []
    for begin, end in spans:
        if merged and begin - merged[-1][1] <= gap:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return merged


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class ReadAhead:
    """The reading thread: `start`, then `stop` (waits for it); `summary` says what it read."""

    def __init__(self, files: list[Path], keep_layers: int | None, limit_bytes: int):
        self.files, self.keep_layers, self.limit = files, keep_layers, limit_bytes
        self.bytes_read = 0
        self.planned = 0  # bytes the load needs, counted as the files' headers are read
        self.done_at: float | None = None  # seconds from the process start to the reader's end
        self.seconds = 0.0
        self.error: str | None = None
        self.stopped = False  # stopped before the end (the load was done, or the worker failed)
        self._stop = threading.Event()
        self._switch: float | None = None  # the switch interval to restore at `stop`
        self.zero_copy = False  # read without a copy into this process (`_fill`)
        self._sink: int | None = None  # /dev/null, while it reads
        self._buffer: memoryview | None = None  # where the sink cannot be used
        self._index = {path: i for i, path in enumerate(files)}
        self._at = (0, 0)  # (file, offset): how far it has read, in its order
        self._ended = False
        self._moved = threading.Condition()  # notified as `_at` moves, and at the end
        self._thread = threading.Thread(target=self._run, name="hsextract-read-ahead", daemon=True)

    def start(self) -> ReadAhead:
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, READER_SWITCH_S))  # until `stop`: the load is done
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        try:
            if hasattr(os, "sendfile"):
                with contextlib.suppress(OSError):  # else read into a buffer
                    self._sink = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            self.zero_copy = self._sink is not None
            for index, path in enumerate(self.files):
                self._move(index, 0)
                ranges = needed_ranges(path, self.keep_layers)
                self.planned += sum(end - begin for begin, end in ranges)
                fd = os.open(path, os.O_RDONLY)
                try:
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window
                    for begin, end in ranges:
                        at = begin
                        while at < end:
                            if self._stop.is_set() or self.bytes_read >= self.limit:
                                self.stopped = self._stop.is_set()
                                return
                            got = self._fill(fd, at, min(CHUNK, end - at))
                            if got <= 0:
                                break  # a file shorter than its header says: the load tells
                            at += got
                            self.bytes_read += got
                            self._move(index, at)
                finally:
                    os.close(fd)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the load reads the same files and says why
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self._sink is not None:
                os.close(self._sink)
                self._sink = None
            self.seconds = time.monotonic() - started
            self.done_at = time.time() - PROCESS_START
            with self._moved:
                self._ended = True
                self._moved.notify_all()

    def _fill(self, fd: int, at: int, size: int) -> int:
        """Up to `size` bytes of `fd` from `at` into the page cache; how many (0 at the file's end). Sent to
        /dev/null, the pages go through no buffer of this process (copied into one, they cost a core and the
        memory's bandwidth beside the imports and the preload's copies: 17.7 s for 47.5 GB already cached on an
        H100 host); read into a buffer where the system cannot send a file."""
        if self._sink is not None:
            try:
                return os.sendfile(self._sink, fd, at, size)
            except OSError:
                os.close(self._sink)
                self._sink = None
        if self._buffer is None:
            self._buffer = memoryview(bytearray(CHUNK))
        self.zero_copy = False
        return os.preadv(fd, [self._buffer[:size]], at)

    def _move(self, index: int, offset: int) -> None:
        with self._moved:
            self._at = (index, offset)
            self._moved.notify_all()

    def covered(self, path: Path, end: int, timeout: float | None = None) -> bool:
        """Wait until the reader has read `path` up to byte `end` (or gone past it, or ended: stopped, at its
        limit, failed, or never started), at most `timeout` seconds; whether it has. A file it does not read
        is covered at once."""
        index = self._index.get(path)
        if index is None or self._thread.ident is None:
            return True
        with self._moved:
            return self._moved.wait_for(lambda: self._ended or self._at >= (index, end), timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the reader to finish on its own (at most `timeout` seconds); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop reading (a range under way ends within one chunk) and wait for the thread."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join()
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None

    def summary(self) -> dict:
        """What the summary's `read_ahead` holds: bytes read, of those the load needs (so far as known), the
        reader's seconds and its end from the process start; `stopped` when it ended before reading them all,
        `error` when a file could not be read."""
        return reader_summary(self, limit_bytes=self.limit, zero_copy=self.zero_copy)


def reader_summary(reader, **fields) -> dict:
    """A reading thread's figures (`ReadAhead`, `preload.Preload`): bytes read and planned, seconds, `fields`, its
    end from the process start, and `stopped` / `error` where so."""
    out = {"bytes": reader.bytes_read, "planned_bytes": reader.planned, "seconds": round(reader.seconds, 3), **fields}
    if reader.done_at is not None:
        out["done_at"] = round(reader.done_at, 3)
    if reader.stopped:
        out["stopped"] = True
    if reader.error:
        out["error"] = reader.error
    return out


def start_read_ahead(opts: WorkerOptions) -> ReadAhead | None:
    """A started `ReadAhead` of the checkpoint `opts` will load; None with --read-ahead-gb 0, a model built
    from its config (--random-weights) or none at all (--synthetic), or where the config or the layers do not
    parse (the worker's own checks say why, a moment later)."""
    if opts.synthetic is not None or opts.random_weights is not None or opts.read_ahead_gb == 0:
        return None
    try:
        info = read_model_info(opts.model)
        layer_ids = parse_layer_spec(opts.layers, info.num_layers)
        files = weight_files(opts.model)
    except Exception:  # noqa: BLE001 - reported by the worker's checks, which follow
        return None
    if not files:
        return None
    keep = layers_to_load(layer_ids, info.num_layers, opts.include_last)
    limit = int(opts.read_ahead_gb * 1e9) if opts.read_ahead_gb is not None else (available_memory() or 0) // 2
    if limit <= 0:
        return None
    return ReadAhead(files, keep, limit).start()
