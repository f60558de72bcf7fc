"""The inventory contract: which hosts run shards, how to reach them, and with which interpreter.

YAML (or a Prefect Block holding the same text):

    known_hosts: ~/.ssh/known_hosts          # optional, default ~/.ssh/known_hosts
    accept_unknown_host_keys: false          # optional opt-in for every host
    hosts:
      - name: gpu1
        hostname: 10.0.0.5                   # "local" runs on this machine without SSH
        port: 22
        user: ubuntu
        key_filename: ~/.ssh/id_ed25519
        gpus: [0, 1, 2, 3]
        workdir: /scratch/hsextract
        python: /opt/venv/bin/python
        accept_unknown_host_keys: false      # optional per-host opt-in
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

LOCAL_HOSTNAME = "local"


class InventoryError(ValueError):
    """The inventory is unusable; the message lists every bad field."""


class HostSpec(BaseModel):
    """One host of the inventory (the contract's fields); unknown keys and bad values are refused."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    hostname: str = Field(min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = None
    key_filename: str | None = None
    gpus: list[int] = Field(min_length=1)
    workdir: str
    python: str = "python3"
    accept_unknown_host_keys: bool | None = None
    known_hosts: str | None = None

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not PurePosixPath(value).is_absolute():
            raise ValueError(f"must be an absolute path on the host, got {value!r}")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: list[int]) -> list[int]:
        if any(g < 0 for g in value) or len(set(value)) != len(value):
            raise ValueError(f"must be distinct device indices >= 0, got {value}")
        return value

    @property
    def is_local(self) -> bool:
        """`hostname: local`: this machine, reached without SSH."""
        return self.hostname == LOCAL_HOSTNAME


class Inventory(BaseModel):
    """The hosts a run may use, and how their SSH host keys are checked."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: list[HostSpec] = Field(min_length=1)
    known_hosts: str = "~/.ssh/known_hosts"
    accept_unknown_host_keys: bool = False

    @model_validator(mode="after")
    def _unique_names(self) -> Inventory:
        names = [h.name for h in self.hosts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate host name(s): {', '.join(dupes)}")
        return self

    def host(self, name: str) -> HostSpec:
        """The host named `name`."""
        return next(h for h in self.hosts if h.name == name)

    def accepts_unknown_keys(self, host: HostSpec) -> bool:
        """Whether `host` may be connected to with a key known_hosts lacks (an explicit opt-in)."""
        return self.accept_unknown_host_keys if host.accept_unknown_host_keys is None else host.accept_unknown_host_keys

    def known_hosts_path(self, host: HostSpec) -> Path:
        """The known_hosts file `host`'s key is checked against."""
        return Path(host.known_hosts or self.known_hosts).expanduser()

    @property
    def slots(self) -> list[tuple[str, int]]:
        """(host name, GPU index) pairs in inventory order: one shard runs on each at a time."""
        return [(h.name, g) for h in self.hosts for g in h.gpus]


def parse_inventory(text: str, source: str = "inventory") -> Inventory:
    """Parse and validate inventory YAML; every problem is named with its location."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InventoryError(f"{source}: not valid YAML: {exc}") from None
    if isinstance(raw, list):
        raw = {"hosts": raw}
    if not isinstance(raw, dict):
        raise InventoryError(f"{source}: expected a mapping with 'hosts:' (or a list of hosts)")
    try:
        return Inventory.model_validate(raw)
    except ValidationError as exc:
        raise InventoryError(f"{source}: " + "; ".join(_describe(e, raw) for e in exc.errors())) from None


def _describe(error: ErrorDetails, raw: dict) -> str:
    loc = list(error["loc"])
    where = ".".join(str(p) for p in loc)
    if len(loc) >= 2 and loc[0] == "hosts" and isinstance(loc[1], int):
        hosts = raw.get("hosts") or []
        entry = hosts[loc[1]] if loc[1] < len(hosts) else {}
        label = entry.get("name", f"#{loc[1]}") if isinstance(entry, dict) else f"#{loc[1]}"
        where = f"host {label}" + ("." + ".".join(str(p) for p in loc[2:]) if loc[2:] else "")
    message = {"extra_forbidden": "unknown key", "missing": "missing"}.get(error["type"], error["msg"])
    return f"{where}: {message}"


def load_inventory(path_or_text: str | Path) -> Inventory:
    """The inventory of a YAML file; InventoryError naming the file and every bad field."""
    path = Path(path_or_text).expanduser()
    if path.is_file():
        return parse_inventory(path.read_text(), str(path))
    raise InventoryError(f"inventory {str(path_or_text)!r}: no such file")


def local_inventory(workdir: Path, python: str, gpus: list[int] | None = None) -> Inventory:
    """The embedded default: this machine, no SSH."""
    return Inventory(hosts=[HostSpec(name="local", hostname=LOCAL_HOSTNAME, gpus=gpus or [0],
                                     workdir=str(workdir), python=python)])
