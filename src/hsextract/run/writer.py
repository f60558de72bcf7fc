"""The writer pipeline between the forward loop and the disk: a batch's states become a durable, journaled file.

`BatchWriter.put` takes a batch's device states; threads copy them to pinned host memory (`HostCopier`), lay
the safetensors file out over those buffers, hash it, write it and seal it (fsync, rename, journal), each
stage bounded, so a slow sink holds the GPU back instead of growing memory. What a file holds and where it
is journaled is the shard's business (`ShardRun.prepare_file`, `write_file`, `seal_file`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from hsextract.data.chat import Tokenized
from hsextract.output.payload import Payload
from hsextract.run.hostcopy import HostCopier, copier_plan

if TYPE_CHECKING:
    from hsextract.run.extract import ShardRun

BAD_KEY = "_nonfinite"  # per-sample flags riding along with a batch's states to the writer thread
STATS_KEY = "_layer_stats"  # per captured layer: sum of squares, all-zero rows, constant rows (`check_states`)


class BatchWriter:
    """Background threads between the forward loop and the disk, each stage bounded.

    The main thread only queues work: the device -> pinned host copy runs on a side stream
    (`HostCopier`). The prepare thread waits for that copy, drops non-finite samples and lays the file
    out in place (reading the pinned buffers, no copy); `hash_workers` threads hash up to that many files
    at once (one core hashes slower than a fast disk writes); the write thread takes the files in order,
    copies file n into the page cache (then frees its pinned buffers) while the seal thread fsyncs file
    n-1, renames and journals it, so the disk never waits for a copy or a hash. Every wait for room
    (`depth` pinned sets, a bounded hand-off between stages) holds the GPU back instead of letting memory
    grow: the sink is the bottleneck.

    The forward loop never waits for the device, so it runs ahead of the GPU by up to `depth` batches;
    each pinned set is made up front for a full batch (`bytes_per_token` x `token_budget`, see
    `copier_plan`), so no copy waits for memory to be pinned.

    `timings()` says where the time went (seconds, summed over a stage's threads): `held_s` the forward
    loop waited for a free pinned set (the sink behind, or the host `depth` batches ahead of the GPU),
    `copy_wait_s` the prepare thread waited for a batch's forward and copy to finish, then each stage's busy
    time, `first_file_s` from the start to the first file sealed, and the pinned sets (`HostCopier.stats`).
    """

    def __init__(self, shard: ShardRun, device: torch.device, depth: int | None = None,
                 hash_workers: int | None = None, bytes_per_token: int = 0, token_budget: int = 0,
                 copier: HostCopier | None = None):
        self.shard = shard
        self.hash_workers = hash_workers or default_hash_workers()
        self.copier = copier or writer_copier(device, self.hash_workers, bytes_per_token, token_budget, depth)
        self.queue: queue.Queue = queue.Queue(maxsize=self.copier.depth)
        self.hashing = ThreadPoolExecutor(self.hash_workers, thread_name_prefix="hsextract-hash")
        self.landing: queue.Queue = queue.Queue(maxsize=self.hash_workers)
        self.sealing: queue.Queue = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.first_sealed: float | None = None
        self.spent: defaultdict[str, float] = defaultdict(float)
        self._spent_lock = threading.Lock()
        self.threads = [threading.Thread(target=target, name=f"hsextract-{target.__name__[1:]}", daemon=True)
                        for target in (self._prepare, self._write, self._seal)]
        for thread in self.threads:
            thread.start()

    def put(self, batch: list[Tokenized], states: dict) -> None:
        """Hand a batch's device states to the pipeline (waits while every stage is full: backpressure)."""
        if self.error:
            raise self.error
        if batch:
            started = time.monotonic()
            self.queue.put((batch, self.copier.stage(states)))
            self._spend("held_s", started)

    def _spend(self, stage: str, started: float) -> None:
        with self._spent_lock:
            self.spent[stage] += time.monotonic() - started

    def _hash(self, payload: Payload) -> None:
        started = time.monotonic()
        payload.hash()
        self._spend("hash_s", started)

    def timings(self) -> dict:
        """Seconds spent per stage, to the first sealed file, and the pinned sets (`HostCopier.stats`)."""
        out = {k: round(v, 3) for k, v in sorted(self.spent.items())}
        if self.copier.cuda:
            out.update(self.copier.stats())
        if self.first_sealed is not None:
            out["first_file_s"] = round(self.first_sealed - self.started, 3)
        return out

    def _fail(self, exc: BaseException) -> None:
        self.error = self.error or exc  # surfaced on the main thread at the next put/close

    def _prepare(self) -> None:
        while (item := self.queue.get()) is not None:
            batch, staged = item
            prepared = None
            if self.error is None:
                try:
                    started = time.monotonic()
                    states = dict(staged.wait())
                    self._spend("copy_wait_s", started)
                    started = time.monotonic()
                    bad = states.pop(BAD_KEY).tolist()
                    stats = states.pop(STATS_KEY, None)
                    rms = None
                    if stats is not None:  # a layer degenerate for the whole batch fails the shard here, unwritten
                        rms = self.shard.check_layers(batch, stats.tolist())
                    batch, states = self.shard.drop_nonfinite(batch, states, bad)
                    if batch:
                        prepared = self.shard.prepare_file(batch, states, hashed=False)
                        prepared.rms = rms
                    self._spend("prepare_s", started)
                except BaseException as exc:
                    self._fail(exc)
            if prepared is None:
                staged.release()
            else:  # the file's data is still in the staged buffers
                self.landing.put((prepared, self.hashing.submit(self._hash, prepared.payload), staged))
        self.landing.put(None)

    def _write(self) -> None:
        while (item := self.landing.get()) is not None:
            prepared, hashed, staged = item
            unsealed = None
            try:
                hashed.result()  # in order: a later file may be hashed first, never written first
                if self.error is None:
                    started = time.monotonic()
                    unsealed = self.shard.write_file(prepared)
                    self._spend("write_s", started)
            except BaseException as exc:
                self._fail(exc)
            prepared.payload = None
            staged.release()  # the bytes are in the page cache: the pinned set can take the next batch
            if unsealed is not None:
                self.sealing.put((prepared, unsealed))
        self.sealing.put(None)

    def _seal(self) -> None:
        while (item := self.sealing.get()) is not None:
            prepared, unsealed = item
            if self.error is not None:
                unsealed.abandon()
                continue
            try:
                started = time.monotonic()
                self.shard.seal_file(prepared, unsealed)
                self._spend("seal_s", started)
                self.first_sealed = self.first_sealed or time.monotonic()
            except BaseException as exc:
                self._fail(exc)

    def close(self) -> None:
        """Finish every file in flight, stop the threads, raise the first error any stage had."""
        self.queue.put(None)
        for thread in self.threads:
            thread.join()
        self.hashing.shutdown()
        if self.error:
            raise self.error


def writer_copier(device: torch.device, hash_workers: int | None = None, bytes_per_token: int = 0,
                   token_budget: int = 0, depth: int | None = None) -> HostCopier:
    """The pinned sets a `BatchWriter` with these settings uses, their pinning begun on a thread (the worker
    makes them while its model loads: pinning holds the driver, and would delay the first batches' launches)."""
    depth = depth or (hash_workers or default_hash_workers()) + 4  # filling, copying, laid out, hashed, writing
    set_bytes = 0
    if bytes_per_token and token_budget:  # each pinned set made up front for a full batch
        depth, set_bytes = copier_plan(bytes_per_token, token_budget, depth)
    return HostCopier(device, depth, set_bytes)


def default_hash_workers() -> int:
    """Files hashed at once: one per four cores, at most 3 (about 5 GiB/s of sha256, over any disk here)."""
    return min(3, max(1, (os.cpu_count() or 1) // 4))
