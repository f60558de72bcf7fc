"""Device -> host copies that never stall the forward loop.

`HostCopier.stage(states)` queues a copy of a batch's device tensors into pinned host memory on a side
stream and returns at once with a `HostCopy` (host tensors + an event). The writer threads wait on the event,
lay the file out and hash it in place, write it to the page cache, then release the set. There are `depth`
sets, each one pinned buffer sized for a full batch (`set_bytes`: the token budget x the bytes per token,
known before the first batch) and reused batch after batch: pinned allocation is slow and stalls the
device, so it happens once, on a thread, while the first batch runs. `stage` waits for a free set, which
bounds host memory and applies backpressure to the GPU when the sink is slower. A batch larger than its set
(a lone sample over the budget) grows that set once. On a CPU device the tensors pass through untouched.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

ALIGN = 256  # each tensor's offset in a set: any dtype's view, and the DMA engine's liking


@dataclass
class HostCopy:
    """A batch's tensors being copied to pinned host memory; `wait` for them, `release` the buffers after."""
    tensors: dict[str, torch.Tensor]
    event: torch.cuda.Event | None = None
    _slot: PinnedSet | None = None
    _free: queue.Queue | None = field(default=None, repr=False)

    def wait(self) -> dict[str, torch.Tensor]:
        """The host tensors, once their copy is complete."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensors

    def release(self) -> None:
        """The host buffers may be reused (call once the tensors are written out)."""
        if self._free is not None and self._slot is not None:
            self._free.put(self._slot)
            self._slot = None


@dataclass
class PinnedSet:
    """One pinned host buffer that a batch's tensors are carved from, one after the other."""
    buffer: torch.Tensor | None = None

    def carve(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """Views of this set shaped like `tensors` (the set grows when they do not fit): (views, bytes grown)."""
        offsets, end = [], 0
        for tensor in tensors.values():
            offsets.append(end)
            end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        grown = 0
        if self.buffer is None or self.buffer.numel() < end:
            grown = end - (0 if self.buffer is None else self.buffer.numel())
            self.buffer = None  # the old one is freed before the new one is pinned
            self.buffer = torch.empty(end, dtype=torch.uint8, pin_memory=True)
        views = {}
        for (name, tensor), offset in zip(tensors.items(), offsets):
            size = tensor.numel() * tensor.element_size()
            views[name] = self.buffer[offset:offset + size].view(tensor.dtype).view(tensor.shape)
        return views, grown


class HostCopier:
    """`depth` pinned sets of `set_bytes` each, reused batch after batch, and the side stream that fills them."""
    def __init__(self, device: torch.device, depth: int = 4, set_bytes: int = 0):
        self.cuda = device.type == "cuda"
        self.depth = depth
        self.set_bytes = set_bytes
        self.pinned_bytes = 0  # pinned so far: the sets made up front, and what batches over a set added
        self.pin_s = 0.0  # seconds spent pinning (on the pinning thread, and in `stage` for a grown set)
        self.grown = 0  # batches that did not fit their set
        self._lock = threading.Lock()
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.free: queue.Queue = queue.Queue()
            self._pinning = threading.Thread(target=self._pin_sets, name="hsextract-pin", daemon=True)
            self._pinning.start()

    def _pin_sets(self) -> None:
        """Make the sets, one at a time, each usable as soon as it is pinned."""
        for _ in range(self.depth):
            started = time.monotonic()
            buffer = None
            if self.set_bytes:
                with contextlib.suppress(RuntimeError):  # pinned memory refused: pinned at its first batch instead
                    buffer = torch.empty(self.set_bytes, dtype=torch.uint8, pin_memory=True)
            with self._lock:
                self.pin_s += time.monotonic() - started
                self.pinned_bytes += 0 if buffer is None else buffer.numel()
            self.free.put(PinnedSet(buffer))

    def stage(self, states: dict[str, torch.Tensor]) -> HostCopy:
        """Queue the copy of `states` to a free set of buffers (waits for one: backpressure on the GPU)."""
        if not self.cuda:
            return HostCopy({k: v.cpu() for k, v in states.items()})
        slot = self.free.get()  # all sets in flight: the sink is behind, so the GPU waits here
        started = time.monotonic()
        host, grown = slot.carve(states)
        if grown:
            with self._lock:
                self.pin_s += time.monotonic() - started
                self.pinned_bytes += grown
                self.grown += 1
        producer = torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(producer)  # the copy starts when the forward that made them is done
            for name, tensor in states.items():
                host[name].copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostCopy(host, event, slot, self.free)

    def stats(self) -> dict:
        """The pinned memory: sets, bytes, seconds spent pinning, batches that outgrew their set."""
        with self._lock:
            return {"pinned_sets": self.depth, "pinned_bytes": self.pinned_bytes, "pin_s": round(self.pin_s, 3),
                    "sets_grown": self.grown}


def copier_plan(bytes_per_token: int, token_budget: int, depth: int, max_bytes: int | None = None
                 ) -> tuple[int, int]:
    """(sets, bytes per set): each set holds a full batch (`token_budget` tokens, plus room for alignment);
    as many sets as `depth` asks while they fit `max_bytes` (default: an eighth of the host's memory, at
    least 4 GiB, as a VM's memory may start small and grow, and at most 16 GiB), and never fewer than 2
    (one filling while one is written)."""
    set_bytes = token_budget * bytes_per_token + 6 * ALIGN  # each of a batch's (at most 6) tensors aligned
    if max_bytes is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = 64 << 30
        max_bytes = min(16 << 30, max(4 << 30, total // 8))
    return max(2, min(depth, max_bytes // set_bytes)), set_bytes
