"""A fleet whose hosts differ the way separate machines do, for the preflight's tests and benchmark: sshd hosts in
network namespaces, some with a problem of their own (a mount namespace with a small tmpfs hiding the model or
filling the disk, a clock off by libfaketime in every session, a host key that is not the one known), and an S3
endpoint (moto) that every namespace reaches."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

from .inventory import ssh_host_entry

FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
#: the problems a host can be given (the preflight must name each on its host)
PROBLEMS = ("nomodel", "full", "skew", "badkey")


def add_hosts(farm, base: Path, model: Path, problems: dict[str, str | None]) -> list[dict]:
    """Add a netns host per name of `problems` ({name: problem or None}) to `farm`; the model must sit under
    `base/models` (hidden on a "nomodel" host). Returns their inventory entries (workdirs `base/w-<name>`,
    one GPU slot each)."""
    for name, problem in problems.items():
        if problem == "nomodel":
            farm.add_host(name, netns=True, mounts={str(base / "models"): 1 << 20})
        elif problem == "full":
            farm.add_host(name, netns=True, mounts={str(base / f"w-{name}"): 8 << 20})
        elif problem == "skew" and Path(FAKETIME).exists():
            farm.add_host(name, netns=True, env={"LD_PRELOAD": FAKETIME, "FAKETIME": "+600"})
        else:
            farm.add_host(name, netns=True)
    good = next(farm.host(n) for n, p in problems.items() if p != "badkey")
    entries = []
    for name, problem in problems.items():
        host = farm.host(name)
        extra = {}
        if problem == "badkey":  # the key known for it is another host's (as after a reinstall, or an impostor)
            known = base / f"known_hosts-{name}"
            known.write_text("\n".join(line.replace(host.host_public_key.split()[1], good.host_public_key.split()[1])
                                       for line in Path(host.known_hosts).read_text().splitlines()) + "\n")
            extra["known_hosts"] = str(known)
        entries.append(ssh_host_entry(host, base / f"w-{name}", gpus=(0,), **extra))
    return entries


def place_model(model: Path, base: Path) -> Path:
    """A copy of `model` under `base/models` (where a "nomodel" host sees an empty directory)."""
    target = base / "models" / model.name
    shutil.copytree(model, target)
    return target


@contextlib.contextmanager
def s3_for(farm, name: str) -> Iterator[str]:
    """moto on every address of this machine, reached by the address host `name`'s namespace routes to (every
    namespace's default route leads to this one): yields the endpoint URL all hosts and this process use."""
    from harness.moto_s3 import start_server

    server = start_server("0.0.0.0")
    try:
        yield f"http://{farm.host(name).gateway or '127.0.0.1'}:{server.get_host_and_port()[1]}"
    finally:
        server.stop()
