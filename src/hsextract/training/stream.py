"""A training input over an output as it is stored (local or s3://): no export, no per-sample files.

`HiddenStatesStream` is a `torch.utils.data.IterableDataset`. Each epoch it lists the output's batch files
(the first copy of every sample, as `read_samples`), optionally shuffles their order and the samples within
each file with `seed` + epoch, and deals the files round-robin to the `world_size` x `num_workers` readers
(DataLoader workers of every rank): every sample exactly once per epoch across all of them. Each reader
fetches `prefetch` files ahead on threads; memory is about `prefetch` + 1 batch files per reader (local files
are mapped, not held: in one process they are checked further ahead, a core each: `reader.hash_threads`). A sample's
tensors are views of its batch (of the file's pages locally, of the downloaded bytes from S3: read-only,
copy before writing into them), so the one copy is the consumer's (collate, pin, to GPU), and a batch stays
in memory while any of its samples does. From a DataLoader worker, samples reach the training process
without that copy too: a local file's views as (file, offset, shape) that the training process maps again,
an S3 object downloaded straight into shared memory and its views sent as that memory's handle; only
tensors computed from a batch (fp8 decoded, speculators' layers stacked) are copied, once. Samples
come in a trainer's key names (`keys`, the export formats), or as the reader's records (`"hsextract"`);
with a `max_length` they are cut to it, and with a trainer's keys, those it would reject are left out (as
`hsextract export` leaves them out).

Ranks receive whole files, so their sample counts differ by up to a file's worth: a DDP loop that needs
equal steps per rank should stop at the smallest (e.g. all-reduce a done flag).
"""

from __future__ import annotations

import os
import random
import threading
from collections import OrderedDict
from functools import partial
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch

from hsextract.errors import UsageError
from hsextract.options import EXPORT_FORMATS

KEYS = ("hsextract", *EXPORT_FORMATS)


class HiddenStatesStream(torch.utils.data.IterableDataset):
    """Samples of `path_or_uri` for a training loop; see the module's docstring."""

    def __init__(self, path_or_uri: str | Path, keys: str = "hsextract", shuffle: bool = False, seed: int = 0,
                 prefetch: int = 2, max_length: int | None = None, rank: int | None = None,
                 world_size: int | None = None, verify: bool | str = True):
        if keys not in KEYS:
            raise UsageError(f"keys={keys!r}: expected one of {', '.join(KEYS)}")
        self.uri, self.keys, self.shuffle, self.seed = str(path_or_uri), keys, shuffle, seed
        self.prefetch, self.max_length, self.verify = max(1, prefetch), max_length, verify
        self.rank, self.world_size = rank, world_size
        # in shared memory: persistent DataLoader workers hold copies of this object, and see set_epoch too
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._checked: dict[str, tuple] = {}  # local files this reader hashed (`read_batches`' `checked`)

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Another shuffle for this epoch (call it on every rank before each epoch's DataLoader iteration, as
        with DistributedSampler; persistent workers see it)."""
        self._epoch.fill_(epoch)

    def _slot(self) -> tuple[int, int]:
        """(this reader's index, how many readers): ranks x DataLoader workers."""
        rank, world = self.rank, self.world_size
        if rank is None or world is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
            else:
                rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return rank * workers + worker, world * workers

    def files(self, store=None) -> tuple[list[tuple[str, dict]], object]:
        """This reader's files this epoch, in the order it reads them, and the output's journal state."""
        from hsextract.store import open_store
        from hsextract.training.reader import first_copies, scan_output

        state = scan_output(store or open_store(self.uri))
        files = first_copies(state)
        order = list(range(len(files)))
        if self.shuffle:
            random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        slot, slots = self._slot()
        return [files[i] for i in order[slot::slots]], state

    def __iter__(self):
        from hsextract.store import open_store
        from hsextract.training.export import LAYOUTS, Source, cut
        from hsextract.training.reader import first_positions, read_batches

        store = open_store(self.uri)  # per reader (a DataLoader worker makes its own S3 client)
        mine, state = self.files(store)
        layout = None
        worker = torch.utils.data.get_worker_info() is not None
        for shard, entry, batch in read_batches(store, mine, self.verify, ahead=self.prefetch, views=True,
                                                shared=worker, checked=self._checked):
            if layout is None and self.keys != "hsextract":
                layout = LAYOUTS[self.keys](Source.of(batch))
                layout.plan()
            positions = first_positions(state, shard, entry, batch)
            if self.shuffle:
                random.Random(f"{self.seed}/{self.epoch}/{shard}/{entry['file']}").shuffle(positions)
            out = partial(_crossing, batch) if worker else (lambda record: record)
            for position in positions:
                sample = cut(batch.sample(position), self.max_length)
                if layout is None:
                    yield out(sample)
                elif layout.reject(sample["loss_mask"]) is None:
                    yield out({"id": sample["id"], **layout.item(sample, own=False)})


class _PageView(torch.Tensor):
    """A view of a local batch file's pages in a DataLoader worker: it crosses to the training process as
    (file, offset, dtype, shape, stride), and is mapped there again (`_remap`): no copy on either side."""
    # what is computed from it is a plain tensor (torch's own idiom; its stubs type the C function without `cls`)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    hsx_page: tuple[str, int]  # (file, offset of the view's data in it), set by `_crossing`


def _crossing(batch, record: dict) -> dict:
    """A DataLoader worker's sample, made to cross to the training process without copying its batch: views
    of a mapped file as `_PageView`s, views of a download already in shared memory as they are (torch sends
    that memory's handle), anything else (computed here: fp8 decoded, layers stacked) copied once into
    shared memory (a view of anything else would carry its whole batch across)."""
    path = batch.path
    base = batch.data.untyped_storage().data_ptr() if path is not None else None
    crossing = {}
    for key, value in record.items():
        if torch.is_tensor(value):
            storage = value.untyped_storage()
            if path is not None and storage.data_ptr() == base:
                value = value.as_subclass(_PageView)
                value.hsx_page = (str(path), value.data_ptr() - base)
            elif value.numel() * value.element_size() <= _BY_VALUE:
                value = value.as_subclass(_ByValue)
            elif not storage.is_shared():
                value = torch.empty(value.shape, dtype=value.dtype).share_memory_().copy_(value)
        crossing[key] = value
    return crossing


class _ByValue(torch.Tensor):
    """A small tensor of a DataLoader worker's sample (token ids, a loss mask): it crosses to the training
    process as its bytes in the message, cheaper than a shared-memory segment of its own."""
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # as `_PageView`'s


_BY_VALUE = 1 << 20


def _reduce_by_value(value: _ByValue):
    plain = value.as_subclass(torch.Tensor).contiguous()
    return _from_bytes, (plain.reshape(-1).view(torch.uint8).numpy().tobytes(), plain.dtype, tuple(plain.shape))


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _reduce_page_view(view: _PageView):
    path, offset = view.hsx_page
    return _remap, (path, offset, view.dtype, tuple(view.shape), view.stride())


_MAPPED: OrderedDict[str, torch.Tensor] = OrderedDict()  # the last files mapped here, by path
_MAPPED_LOCK = threading.Lock()  # a DataLoader's pin-memory thread unpickles too


def _remap(path: str, offset: int, dtype: torch.dtype, shape: tuple, stride: tuple) -> torch.Tensor:
    """A `_PageView` arrived: the same view of the same file, mapped in this process."""
    from hsextract.output.batchfile import map_pages

    if 0 in shape:
        return torch.empty(shape, dtype=dtype)
    with _MAPPED_LOCK:
        pages = _MAPPED.pop(path, None)
        _MAPPED[path] = pages = map_pages(path) if pages is None else pages
        while len(_MAPPED) > 8:
            _MAPPED.popitem(last=False)
    size = torch.empty(0, dtype=dtype).element_size()
    end = offset + size * (1 + sum((n - 1) * step for n, step in zip(shape, stride)))
    if end > pages.numel():
        raise ValueError(f"{path}: {pages.numel()} bytes, a sample's view reaches byte {end} (was it replaced?)")
    return pages[offset:end].view(dtype).as_strided(shape, stride)


ForkingPickler.register(_PageView, _reduce_page_view)
ForkingPickler.register(_ByValue, _reduce_by_value)
