"""Inventory files for tests: the YAML of tasks/inventory.py, and an entry that logs in to a farm host."""

from __future__ import annotations

import sys
from pathlib import Path


def write_inventory(path: Path, hosts: list[dict], **top) -> Path:
    """Inventory YAML from dicts (see tasks/inventory.py); returns its path."""
    import yaml

    path.write_text(yaml.safe_dump({**top, "hosts": hosts}))
    return path


def ssh_host_entry(farm_host, workdir: Path, gpus=(0, 1), python: str | None = None, **extra) -> dict:
    return {"name": farm_host.name, "hostname": farm_host.hostname, "port": farm_host.port, "user": farm_host.user,
            "key_filename": str(farm_host.key_filename), "known_hosts": str(farm_host.known_hosts),
            "gpus": list(gpus), "workdir": str(workdir), "python": python or sys.executable, **extra}
