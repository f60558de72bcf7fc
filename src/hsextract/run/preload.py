"""The checkpoint's tensors read from its files straight into the model's device on a thread, while the worker
goes on importing transformers and the model's code and loading the tokenizer.

Those imports hold the interpreter for seconds (10-14 s on a GPU host's image), and the model's load used to
begin only after them: `Preload` starts as soon as torch is imported. Every tensor the load needs
(`readahead.loaded`: not layers past the last one run, not the MTP head, not lm_head, which the worker drops) gets
device memory of its own. Two threads share the files; each reads its file in chunks into two pinned host
buffers in turn, each chunk copied to the device on a side stream while the next is read (one copy in host
memory, page cache to pinned buffer, and none after it); the first and last bytes of every copy are then read
back and compared with the file's. On a CPU device the bytes are read straight into the tensors. The reads
release the interpreter's lock, so the imports go on beside them. They follow `ReadAhead`, which reads the same
bytes into the page cache from the process's start: a chunk is read once the read-ahead has read it
(`ReadAhead.covered`), so the disk serves one reader in order, and the preload copies from memory as fast as the
disk fills it.

transformers then builds the model around these tensors (`from_pretrained(state_dict=...)`: the same renames and
conversions as from the files, and no copy where the dtype is the run's). Not used, the load reading the files
itself as before, when the checkpoint is quantized (its config has a `quantization_config`), holds a dtype torch
does not know, or more than 1/16 of its bytes are of a dtype other than the run's (transformers would convert
them, and the preloaded and converted tensors would both be held).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import threading
import time
from pathlib import Path

import torch

from hsextract.run.liveness import PROCESS_START
from hsextract.run.readahead import CHUNK, ReadAhead, loaded, merge, read_header, reader_summary, weight_files

#: safetensors' dtype names
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
#: bytes at each end of every copy read back from the device and compared with the file's
SPOT = 64
#: threads reading the files to the device, each its own files (staged path): from a checkpoint mostly in the
#: page cache, beside the imports, one thread copied 47.5 GB in 12.0-12.6 s on an H100 host, two in 7.0 s
READERS = 2
#: the share of a checkpoint's bytes that may be of another dtype than the run's (converted by transformers)
OTHER_DTYPE_SHARE = 1 / 16


class TensorToRead:
    """One tensor to read: its name, dtype, shape and byte range in its file."""
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: torch.dtype, shape: list[int], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def plan(files: list[Path], keep_layers: int | None) -> list[tuple[Path, list[TensorToRead]]]:
    """Per file, the tensors the load reads, in file order. ValueError naming the file and tensor where a header
    is not what it should be; OSError where a file cannot be read."""
    out = []
    for path in files:
        base, header = read_header(path)
        size = path.stat().st_size
        entries = []
        for name, meta in header.items():
            if not loaded(name, keep_layers):
                continue
            try:
                dtype = DTYPES[meta["dtype"]]
                (begin, end), shape = meta["data_offsets"], [int(n) for n in meta["shape"]]
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path}: tensor {name!r}: dtype {meta.get('dtype')!r} or its offsets or shape "
                                 f"are not what this worker reads") from None
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise ValueError(f"{path}: tensor {name!r}: {end - begin} bytes for shape {shape} of {dtype}")
            if base + end > size:
                raise ValueError(f"{path}: tensor {name!r} ends at byte {base + end}, past the file's end ({size}): "
                                 f"a file cut short?")
            entries.append(TensorToRead(name, dtype, shape, base + begin, base + end))
        entries.sort(key=lambda e: e.begin)
        out.append((path, entries))
    return out


def why_not(model_dir: Path, files: list[tuple[Path, list[TensorToRead]]], dtype: torch.dtype) -> str | None:
    """Why the load should read the files itself (None: preload): a quantized checkpoint, or too many bytes of
    another dtype than the run's."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "its config.json does not read"  # the load says what is wrong with it
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if "quantization_config" in config or "quantization_config" in text:
        return "a quantized checkpoint (transformers' quantizer reads the files)"
    total = sum(e.end - e.begin for _, entries in files for e in entries)
    other = sum(e.end - e.begin for _, entries in files for e in entries if e.dtype != dtype)
    if total and other > total * OTHER_DTYPE_SHARE:
        return (f"{other / total:.0%} of its bytes are not {str(dtype).removeprefix('torch.')} (converted by "
                f"transformers, they would be held twice)")
    return None


def _writable(tensor: torch.Tensor, offset: int = 0, length: int | None = None) -> memoryview:
    """The bytes of a contiguous host tensor (pinned or not) as a writable buffer, for `os.preadv`."""
    size = tensor.numel() * tensor.element_size() if length is None else length
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr() + offset)).cast("B")


class Preload:
    """The reading thread: `start`, then `tensors` (waits; the state dict, or None with `error`/`stopped` set), or
    `stop`; `summary` says what it read. On CUDA (or with `staged`) `readers` threads share the files, the bytes
    going through staging buffers and checked on the device (`_staged`); on a CPU device one thread reads them
    straight into the tensors."""

    def __init__(self, files: list[tuple[Path, list[TensorToRead]]], device: torch.device, chunk: int = CHUNK,
                 staged: bool = False, follow: ReadAhead | None = None, readers: int = READERS):
        self.files, self.device, self.chunk, self.readers = files, device, chunk, max(1, readers)
        self.staged = staged  # on CPU too, the GPU's way: through the staging buffers, the copies checked
        self.follow = follow  # the read-ahead of the same files: each chunk read once it has read it
        self.waited = 0.0  # seconds spent waiting for the read-ahead (the disk)
        self.planned = sum(e.end - e.begin for _, entries in files for e in entries)
        self.bytes_read = 0
        self.seconds = 0.0
        self.done_at: float | None = None  # seconds from the process start to the reader's end
        self.error: str | None = None
        self.stopped = False
        self.taken = False  # the tensors went to the model's load
        self._out: dict[str, torch.Tensor] | None = {}
        self._stop = threading.Event()
        self._failed = threading.Event()  # one of the staged readers failed: the others end too
        self._counting = threading.Lock()  # `bytes_read` and `waited`, counted by every reader
        self._thread = threading.Thread(target=self._run, name="hsextract-preload", daemon=True)

    def start(self) -> Preload:
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        try:
            if self.device.type == "cuda" or self.staged:
                self._staged()
            else:
                self._to_host()
        except Exception as exc:  # noqa: BLE001 - the load reads the same files itself and says what is wrong
            self.error = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            self.stopped = self._stop.is_set()
            self.seconds = time.monotonic() - started
            self.done_at = time.time() - PROCESS_START

    def _ended(self) -> bool:
        return self._stop.is_set() or self._failed.is_set()  # stopped, or another reader failed

    def _read(self, fd: int, path: Path, view: memoryview, at: int) -> int | None:
        """Bytes `at`.. of `path` into `view` once the read-ahead has read them; how many, or None when
        stopped or another reader failed."""
        if self._ended():
            return None
        if self.follow is not None and not self.follow.covered(path, at + len(view), 0):
            began = time.monotonic()
            while not self.follow.covered(path, at + len(view), 0.05):
                if self._ended():
                    return None
            with self._counting:
                self.waited += time.monotonic() - began
        return os.preadv(fd, [view], at)

    def _alloc(self, entry: TensorToRead) -> torch.Tensor:
        raw = torch.empty(entry.end - entry.begin, dtype=torch.uint8, device=self.device)
        assert self._out is not None  # dropped only after the readers ended (`stop`, `tensors` join them first)
        self._out[entry.name] = raw.view(entry.dtype).view(entry.shape)
        return raw

    def _to_host(self) -> None:
        for path, entries in self.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                for entry in entries:
                    raw = self._alloc(entry)
                    at = 0
                    while at < raw.numel():
                        view = _writable(raw, at, min(self.chunk, raw.numel() - at))
                        got = self._read(fd, path, view, entry.begin + at)
                        if got is None:
                            return
                        if got <= 0:
                            raise ValueError(f"{path}: ends inside tensor {entry.name!r}")
                        at += got
                        self.bytes_read += got
            finally:
                os.close(fd)

    def _staged(self) -> None:
        """The files shared among `readers` threads (this one and helpers), each with its own staging buffers and
        side stream (`_stage_files`); the first error of any of them is raised here, and ends the others."""
        todo = list(reversed(self.files))  # popped from the end: in file order, as the read-ahead reads them
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                self._stage_files(todo)
            except BaseException as exc:  # noqa: BLE001 - raised in this thread, below
                errors.append(exc)
                self._failed.set()

        helpers = [threading.Thread(target=reader, name=f"hsextract-preload-{n}", daemon=True)
                   for n in range(1, self.readers)]
        for helper in helpers:
            helper.start()
        reader()
        for helper in helpers:
            helper.join()
        if errors:
            raise errors[0]

    def _stage_files(self, todo: list[tuple[Path, list[TensorToRead]]]) -> None:
        """Files taken from `todo` until none is left: each one's needed ranges read in chunks into two staging
        buffers in turn (pinned on CUDA), each chunk copied into its tensors (on a side stream on CUDA, while the
        next is read). Then the first and last `SPOT` bytes of every copy are read back from the device and
        compared with the file's: a copy that did not land, landed elsewhere or read a buffer already refilled
        fails the preload (the load then reads the files itself). Summing every byte instead was slower than the
        disk on a CPU core."""
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        staging = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        turn = 0
        try:
            while not self._failed.is_set():
                try:
                    path, entries = todo.pop()  # atomic: the threads never take one file twice
                except IndexError:
                    return
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    raws = [self._alloc(e) for e in entries]  # this stream's own memory: no other kernel uses it
                spots: list[tuple[int, int, int]] = []  # (entry, offset in its tensor, bytes): what is checked
                expected = bytearray()  # those bytes as read from the file
                fd = os.open(path, os.O_RDONLY)
                try:
                    first = 0  # the first entry not wholly copied yet
                    for begin, end in merge([(e.begin, e.end) for e in entries], gap=0):
                        at = begin
                        while at < end:
                            buffer = staging[turn]
                            if copied is not None:  # CUDA
                                copied[turn].synchronize()  # its previous chunk is on the device
                            got = self._read(fd, path, _writable(buffer, 0, min(self.chunk, end - at)), at)
                            if got is None:
                                return
                            if got <= 0:
                                raise ValueError(f"{path}: ends at byte {at}, inside a tensor its header names")
                            while first < len(entries) and entries[first].end <= at:
                                first += 1
                            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                                self._scatter(entries, raws, first, buffer, at, got, spots, expected)
                                if copied is not None:  # CUDA
                                    copied[turn].record(stream)
                            turn ^= 1
                            at += got
                            with self._counting:
                                self.bytes_read += got
                finally:
                    os.close(fd)
                self._check(path, entries, raws, spots, expected, stream)
        finally:
            if stream is not None:  # CUDA
                stream.synchronize()  # every copy landed (or, stopped, none still reads the pinned buffers)

    def _scatter(self, entries: list[TensorToRead], raws: list[torch.Tensor], first: int, buffer: torch.Tensor, at: int,
                 got: int, spots: list[tuple[int, int, int]], expected: bytearray) -> None:
        """The chunk of `got` bytes read at file offset `at` into `buffer`, copied into the tensors of `entries`
        (from `first` on) that it overlaps, on the current stream; the ends of each copy noted in `spots` and
        their bytes in `expected`, for the check after the file."""
        i = first
        while i < len(entries) and entries[i].begin < at + got:
            e = entries[i]
            lo, hi = max(e.begin, at), min(e.end, at + got)
            if hi > lo:
                self._copy(raws[i][lo - e.begin:hi - e.begin], buffer[lo - at:hi - at])
                n = min(SPOT, hi - lo)
                for start in (lo,) if hi - n == lo else (lo, hi - n):  # its ends
                    spots.append((i, start - e.begin, n))
                    expected += _writable(buffer, start - at, n)
            i += 1

    @staticmethod
    def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
        dest.copy_(src, non_blocking=True)

    def _check(self, path: Path, entries: list[TensorToRead], raws: list[torch.Tensor],
               spots: list[tuple[int, int, int]], expected: bytearray, stream) -> None:
        """The bytes `spots` name, read back from the device after this file's copies (one transfer), against
        those read from the file; ValueError naming the first tensor that differs."""
        if not spots:
            return
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            landed = torch.cat([raws[i][at:at + n] for i, at, n in spots]).cpu()
        want = torch.frombuffer(expected, dtype=torch.uint8)
        if torch.equal(landed, want):
            return
        at = 0
        for i, offset, n in spots:
            if not torch.equal(landed[at:at + n], want[at:at + n]):
                raise ValueError(f"{path}: tensor {entries[i].name!r} on the {self.device.type} does not hold the "
                                 f"bytes read from the file at its byte {offset} (a copy lost or misplaced)")
            at += n

    def tensors(self) -> dict[str, torch.Tensor] | None:
        """Wait for the reader; the tensors by their checkpoint names (handed over once: the caller holds them),
        or None where it failed (`error`) or was stopped."""
        self._thread.join()
        if self.error or self.stopped:
            self.stop()  # drops what it read
            return None
        out, self._out = self._out, None
        self.taken = True
        return out

    def stop(self) -> None:
        """Stop reading (within one chunk), wait for the thread and drop what it read."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        if self._out and self.device.type == "cuda":
            self._out = None
            torch.cuda.empty_cache()  # the side stream's memory back to the device, for a load from the files
        self._out = None

    def summary(self) -> dict:
        """The summary's `preload`: bytes read of those planned, tensors, seconds, its end from the process start;
        `used` whether the model was built around them; `waited_s`, the seconds its readers waited for the
        read-ahead (summed over them); `error` or `stopped` where not."""
        return reader_summary(self, tensors=sum(len(entries) for _, entries in self.files), used=self.taken,
                              waited_s=round(self.waited, 3))


def start_preload(model_dir: Path, keep_layers: int | None, device: str, dtype: torch.dtype,
                  follow: ReadAhead | None = None) -> tuple[Preload | None, str | None]:
    """A started `Preload` of what the load of `model_dir`'s first `keep_layers` layers reads, following the
    read-ahead `follow` where there is one, or None and why not (the load then reads the files itself, and says
    what is wrong with one that does not read)."""
    try:
        files = weight_files(model_dir)
        if not files:
            return None, "no safetensors files"
        entries = plan(files, keep_layers)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    reason = why_not(model_dir, entries, dtype)
    if reason:
        return None, reason
    return Preload(entries, torch.device(device), follow=follow).start(), None
