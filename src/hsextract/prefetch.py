"""Read the model's weight files into the page cache while the worker starts (no torch here).

A worker spends its first seconds importing torch and transformers, initialising CUDA and reading the
dataset, and only then asks transformers for the weights, which it reads from disk. `WeightPrefetch` reads
the safetensors files the run will load (the layers up to the last one captured, per the checkpoint's
index, and every tensor of no layer) on a thread from the moment the worker starts, so the disk works while
the rest of the start-up does, and the load that follows finds the bytes in memory. It reads only what
fits: with less free memory than twice the files' size it reads none and says so (the load then reads
them itself, as before). Reading releases the GIL.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

_LAYER = re.compile(r"\.layers\.(\d+)\.")
CHUNK = 16 << 20


def files_to_load(model_dir: Path, keep_layers: int) -> list[Path]:
    """The safetensors files holding a tensor of a layer below `keep_layers` or of no layer (embeddings,
    norms, head): per `model.safetensors.index.json` when there is one, else every safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            weight_map = None
        if isinstance(weight_map, dict):
            wanted = set()
            for name, file in weight_map.items():
                layer = _LAYER.search(name)
                if layer is None or int(layer.group(1)) < keep_layers:
                    wanted.add(file)
            return sorted(model_dir / f for f in wanted if (model_dir / f).is_file())
    return sorted(model_dir.glob("*.safetensors"))


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class WeightPrefetch(threading.Thread):
    """Reads `files` once, in order, into the page cache; `report()` says what it did."""

    def __init__(self, files: list[Path]):
        super().__init__(name="hsextract-prefetch", daemon=True)
        self.files = files
        self.total = sum(f.stat().st_size for f in files)
        self.read_bytes = 0
        self.seconds = 0.0
        self.skipped = ""
        self.error = ""
        self._halt = threading.Event()
        free = available_memory()
        if free is not None and self.total * 2 > free:
            self.skipped = (f"{self.total / 1e9:.1f} GB of weights, {free / 1e9:.1f} GB of memory available: "
                            f"not read ahead")

    def run(self) -> None:
        if self.skipped:
            return
        started = time.monotonic()
        buffer = bytearray(CHUNK)
        try:
            for path in self.files:
                with path.open("rb", buffering=0) as handle:
                    while not self._halt.is_set() and (n := handle.readinto(buffer)):
                        self.read_bytes += n
        except OSError as exc:  # the load that follows reads them itself and reports what is wrong
            self.error = f"{type(exc).__name__}: {exc}"
        self.seconds = time.monotonic() - started

    def stop(self) -> None:
        """No model is needed after all (nothing pending): stop reading."""
        self._halt.set()

    def report(self) -> str:
        """One line for the log: bytes read ahead and how long it took (or why it did not)."""
        if self.skipped:
            return self.skipped
        done = "done" if not self.is_alive() else "still reading"
        line = (f"{self.read_bytes / 1e9:.2f} of {self.total / 1e9:.2f} GB in {len(self.files)} file(s) read ahead"
                f" ({done}{f', {self.seconds:.1f}s' if not self.is_alive() else ''})")
        return line + (f"; stopped: {self.error}" if self.error else "")
