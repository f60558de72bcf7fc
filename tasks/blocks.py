"""Prefect Blocks of the project: the host inventory, storable in the Prefect server by name."""

from __future__ import annotations

from prefect.blocks.core import Block


class HostInventory(Block):
    """The inventory YAML (see tasks/inventory.py), loaded with `HostInventory.load(name)`."""

    _block_type_name = "hsextract host inventory"
    yaml: str
