"""Device -> host copies that never stall the forward loop.

`HostStaging.stage(states)` queues a copy of a batch's device tensors into pinned host buffers on a side
stream and returns at once with a `Staged` (host tensors + an event). The writer threads wait on the event,
lay the file out and hash it in place, write it to the page cache, then release the buffers. There are `depth` sets of pinned buffers, reused batch after batch
(pinned allocation is slow); `stage` waits for a free set, which bounds host memory and applies
backpressure to the GPU when the sink is slower. On a CPU device the tensors pass through untouched.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import torch


@dataclass
class Staged:
    """A batch's tensors being copied to pinned host memory; `wait` for them, `release` the buffers after."""
    tensors: dict[str, torch.Tensor]
    event: "torch.cuda.Event | None" = None
    _slot: dict | None = None
    _free: "queue.Queue | None" = field(default=None, repr=False)

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


class HostStaging:
    """`depth` sets of pinned host buffers, reused batch after batch, and the side stream that fills them."""
    def __init__(self, device: torch.device, depth: int = 4):
        self.cuda = device.type == "cuda"
        self.depth = depth
        self.pinned_bytes = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.free: queue.Queue = queue.Queue()
            for _ in range(depth):
                self.free.put({})

    def stage(self, states: dict[str, torch.Tensor]) -> Staged:
        """Queue the copy of `states` to a free set of buffers (waits for one: backpressure on the GPU)."""
        if not self.cuda:
            return Staged({k: v.cpu() for k, v in states.items()})
        slot = self.free.get()  # all sets in flight: the sink is behind, so the GPU waits here
        producer = torch.cuda.current_stream()
        host = {}
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(producer)  # the copy starts when the forward that made them is done
            for name, tensor in states.items():
                need = tensor.numel() * tensor.element_size()
                buffer = slot.get(name)
                if buffer is None or buffer.numel() < need:
                    self.pinned_bytes += need - (0 if buffer is None else buffer.numel())
                    buffer = slot[name] = torch.empty(need, dtype=torch.uint8, pin_memory=True)
                view = buffer[:need].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
                host[name] = view
            event = torch.cuda.Event()
            event.record(self.stream)
        return Staged(host, event, slot, self.free)
