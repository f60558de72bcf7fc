"""hsextract: the extraction worker that runs on each GPU host.

Importing this package is cheap (no torch): the CLI prints its STARTED line before anything heavy loads.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "read_samples", "HiddenStatesDataset", "HiddenStatesStream", "CorruptOutput"]


def __getattr__(name: str):
    if name in ("read_samples", "HiddenStatesDataset"):
        from hsextract.training import reader

        return getattr(reader, name)
    if name == "CorruptOutput":
        from hsextract.errors import CorruptOutput

        return CorruptOutput
    if name == "HiddenStatesStream":
        from hsextract.training.stream import HiddenStatesStream

        return HiddenStatesStream
    raise AttributeError(f"module 'hsextract' has no attribute {name!r}")
