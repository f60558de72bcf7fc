"""A training input over an output as it is stored (local or s3://): no export, no per-sample files.

`HiddenStatesStream` is a `torch.utils.data.IterableDataset`. Each epoch it lists the output's batch files
(the first copy of every sample, as `read_samples`), optionally shuffles their order and the samples within
each file with `seed` + epoch, and deals the files round-robin to the `world_size` x `num_workers` readers
(DataLoader workers of every rank): every sample exactly once per epoch across all of them. Each reader
fetches `prefetch` files ahead on threads; memory is about `prefetch` + 1 batch files per reader. A sample's
tensors are views of its batch (of the file's pages locally, of the downloaded bytes from S3: read-only,
copy before writing into them), so the one copy is the consumer's (collate, pin, to GPU), and a batch stays
in memory while any of its samples does; in a DataLoader worker each sample is copied once, into shared
memory, which is how it reaches the training process. Samples
come in a trainer's key names (`keys`, the export formats), or as the reader's records (`"hsextract"`);
with a `max_length` they are cut to it, and with a trainer's keys, those it would reject are left out (as
`hsextract export` leaves them out).

Ranks receive whole files, so their sample counts differ by up to a file's worth: a DDP loop that needs
equal steps per rank should stop at the smallest (e.g. all-reduce a done flag).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from .errors import UsageError
from .options import EXPORT_FORMATS

KEYS = ("hsextract", *EXPORT_FORMATS)


class HiddenStatesStream(torch.utils.data.IterableDataset):
    """Samples of `path_or_uri` for a training loop; see the module's docstring."""

    def __init__(self, path_or_uri: str | Path, keys: str = "hsextract", shuffle: bool = False, seed: int = 0,
                 prefetch: int = 2, max_length: int | None = None, rank: int | None = None,
                 world_size: int | None = None, verify: bool = False):
        if keys not in KEYS:
            raise UsageError(f"keys={keys!r}: expected one of {', '.join(KEYS)}")
        self.uri, self.keys, self.shuffle, self.seed = str(path_or_uri), keys, shuffle, seed
        self.prefetch, self.max_length, self.verify = max(1, prefetch), max_length, verify
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Another shuffle for this epoch (call it on every rank, as with DistributedSampler)."""
        self.epoch = epoch

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
        from .reader import _first_copies, _scan
        from .store import open_store

        state = _scan(store or open_store(self.uri))
        files = _first_copies(state)
        order = list(range(len(files)))
        if self.shuffle:
            random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        slot, slots = self._slot()
        return [files[i] for i in order[slot::slots]], state

    def __iter__(self):
        from .export import LAYOUTS, Source, cut
        from .reader import _batches, _first_positions
        from .store import open_store

        store = open_store(self.uri)  # per reader (a DataLoader worker makes its own S3 client)
        mine, state = self.files(store)
        layout = None
        out = _to_shared if torch.utils.data.get_worker_info() is not None else (lambda record: record)
        for shard, entry, batch in _batches(store, mine, self.verify, ahead=self.prefetch, views=True):
            if layout is None and self.keys != "hsextract":
                layout = LAYOUTS[self.keys](Source.of(batch))
                layout.plan()
            positions = _first_positions(state, shard, entry, batch)
            if self.shuffle:
                random.Random(f"{self.seed}/{self.epoch}/{shard}/{entry['file']}").shuffle(positions)
            for position in positions:
                sample = cut(batch.sample(position), self.max_length)
                if layout is None:
                    yield out(sample)
                elif layout.reject(sample["loss_mask"]) is None:
                    yield out({"id": sample["id"], **layout.item(sample, own=False)})


def _to_shared(record: dict) -> dict:
    """A DataLoader worker's sample: each tensor copied once, straight into shared memory, so that only the
    sample's own bytes cross to the training process (a view would carry its whole batch across)."""
    shared = {}
    for key, value in record.items():
        if torch.is_tensor(value):
            value = torch.empty(value.shape, dtype=value.dtype).share_memory_().copy_(value)
        shared[key] = value
    return shared
