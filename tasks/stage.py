"""Staging: a run's dataset and model brought to every host before any launch, each byte verified.

`model` and `data` may name, besides a path every host already has:
  - `s3://bucket/key` (one object) or `s3://bucket/prefix/` (every object under it): each host fetches what it
    lacks itself, in parallel ranged GETs (`hsextract stage fetch`), with the run's S3 credentials (the
    prefect-aws block of `aws_credentials`, as a 0600 file, never argv);
  - `orchestrator:/path` (a file or directory on the machine running the flow): sent over SFTP
    (`Host.append_file`, resuming a partial file where it stopped), then verified on the host
    (`hsextract stage place`).
Every file lands once in the host's content-addressed cache `<workdir>/inputs` (hsextract.data.inputcache), checked
by size and sha256 against the source's manifest; the worker reads the source's view there. A host first
says what it lacks and how much space it has: one without the space fails before a byte is sent. A file
already there is not sent again; a partial one resumes.

A source with no manifest yet (the first staging of an S3 source) is fetched all the same: every host hashes
what it fetches, and once they agree (`settle_manifests`) the manifest is written next to the source.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from hsextract.data.inputcache import PRUNE_AFTER_S, Cache
from hsextract.data.sources import (
    Manifest,
    SourceFile,
    StageError,
    local_manifest,
    manifest_uri,
    s3_manifest,
    write_s3_manifest,
)
from hsextract.errors import Retry
from hsextract.options import WorkerOptions
from hsextract.store import in_s3

from .commands import hsextract_cmd, quote
from .credentials import S3Access, access_on
from .failures import said
from .hosts import Host, HostError, SshHost

ORCHESTRATOR = "orchestrator:"
ROLES = ("model", "data")
MIN_RATE = 10 << 20     # bytes/s a staging command is allowed at the least before it is declared hung
BASE_TIMEOUT_S = 120.0


class StageFailed(Exception):
    """Staging on a host failed; `retry` NEVER: the input is wrong; NOW (the default): it may be a blip."""

    def __init__(self, message: str, evidence: str = "", retry: Retry = Retry.NOW):
        super().__init__(message)
        self.evidence, self.retry = evidence, retry


def is_staged(uri: str) -> bool:
    """Whether an input is staged onto the hosts (an s3:// or orchestrator: source) or already there (a path)."""
    return in_s3(uri) or uri.startswith(ORCHESTRATOR)


def cache_dir(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/inputs"


@dataclass(frozen=True)
class Source:
    """An input to stage: which one (`role`), where from, and its manifest (all digests known, except at the
    first staging of an S3 source)."""
    role: str
    uri: str
    manifest: Manifest
    local: str | None = None   # the orchestrator's path, for an orchestrator: source

    @property
    def from_s3(self) -> bool:
        return self.local is None


def resolve_source(role: str, uri: str, access: S3Access) -> Source:
    """The source behind `uri`, checked here before any host is touched: it exists, its manifest matches it,
    and a model has its config.json. ValueError naming the parameter and file else."""
    try:
        if uri.startswith(ORCHESTRATOR):
            path = uri.removeprefix(ORCHESTRATOR)
            if not path.startswith("/"):
                raise StageError(f"{uri!r}: expected {ORCHESTRATOR}/absolute/path")
            manifest = local_manifest(Path(path))
            source = Source(role, uri, Manifest(uri, manifest.kind, manifest.files), path)
        else:
            source = Source(role, uri, s3_manifest(access.client(), uri))
    except StageError as exc:
        raise ValueError(f"{role}={uri!r}: {exc}") from None
    if role == "model" and (source.manifest.kind != "dir" or
                            "config.json" not in {e.path for e in source.manifest.files}):
        raise ValueError(f"model={uri!r}: no config.json at its top (a model is a directory as "
                         f"save_pretrained writes it: config.json, tokenizer, *.safetensors)")
    return source


def resolve_sources(model: str, data: str, access: S3Access) -> dict[str, Source]:
    """The staged inputs among a run's `model` and `data`, by role."""
    places = {"model": model, "data": data}
    return {role: resolve_source(role, places[role], access) for role in ROLES if is_staged(places[role])}


@dataclass
class Staged:
    """One host's staging: per role, the path its workers read, the files' digests, and what was sent."""
    host: str
    paths: dict[str, str] = field(default_factory=dict)
    digests: dict[str, dict[str, str]] = field(default_factory=dict)
    sent_bytes: int = 0
    resumed_bytes: int = 0
    kept_files: int = 0
    seconds: float = 0.0


def on_host(options: WorkerOptions, staged: Staged | None) -> WorkerOptions:
    """`options` with the model and dataset a host's workers read: its staged copies, where the run stages them."""
    if staged is None:
        return options
    paths: dict[str, Any] = {role: Path(path) for role, path in staged.paths.items()}  # fields `model`, `data`
    return replace(options, **paths)


def _stage_cmd(host: Host, bundle_sha256: str, action: str, manifests: list[str], extra: Sequence[str] = ()) -> str:
    spec = host.spec
    return hsextract_cmd(spec.workdir, bundle_sha256, spec.python,
                         ["stage", action, "--cache", cache_dir(spec.workdir),
                          *(a for m in manifests for a in ("--manifest", m)), "--host", host.name, *extra])


def _run_stage(host: Host, command: str, timeout: float, what: str) -> list[dict] | dict:
    result = host.run(command, timeout)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("STAGE ")), None)
    if result.ok and line is not None:
        return json.loads(line[6:])
    raise StageFailed(f"host {host.name}: staging {what}: {said(result).removeprefix('hsextract: ')}",
                      result.describe(), Retry.NEVER if result.returncode == 2 else Retry.NOW)


def _prunable(host: Host, bundle_sha256: str, manifests: list[str]) -> int:
    """The bytes `hsextract stage prune` would free in the host's cache, keeping these sources; 0 when the dry run
    fails (it only adds to a message about the space)."""
    try:
        return cast(dict, _run_stage(host, _stage_cmd(host, bundle_sha256, "prune", manifests, ["--dry-run"]),
                                     BASE_TIMEOUT_S, "a dry run of prune"))["bytes"]  # prune prints one object
    except (StageFailed, HostError):
        return 0


def stage_host(host: Host, sources: dict[str, Source], bundle_sha256: str, access: S3Access, log=None,
               threads: int = 8, part_mib: int = 16) -> Staged:
    """Stage every source on `host` (its bundle already deployed): the space first for all of them, then the
    missing files (from S3 in one `hsextract stage fetch` for all S3 sources; from the orchestrator over SFTP,
    then one `hsextract stage place`), each verified; the paths its workers read. StageFailed naming the host
    and file. From S3, `threads` ranged GETs of `part_mib` MiB each are in flight per host."""
    started = time.monotonic()
    staged = Staged(host.name)
    cache = cache_dir(host.spec.workdir)
    nonce = uuid.uuid4().hex[:12]
    roles = list(sources)
    host.run(f"mkdir -p {quote(cache + '/manifests')} {quote(cache + '/partial')}", BASE_TIMEOUT_S)
    manifests = {role: f"{cache}/manifests/{sources[role].manifest.id}-{nonce}.json" for role in roles}
    try:
        for role in roles:
            host.put(sources[role].manifest.to_json().encode(), manifests[role], BASE_TIMEOUT_S, mode=0o640)
        what = " and ".join(sources[r].uri for r in roles)
        status = dict(zip(roles, _run_stage(host, _stage_cmd(host, bundle_sha256, "status", list(manifests.values())),
                                            BASE_TIMEOUT_S, what)))  # what the host lacks, before a byte is sent
        need = sum(s["missing_bytes"] for s in status.values())
        free = min(s["free_bytes"] for s in status.values()) if status else 0
        if need > free:
            prunable = _prunable(host, bundle_sha256, list(manifests.values()))
            prune = (f"`{_stage_cmd(host, bundle_sha256, 'prune', [])}` frees {prunable:,} bytes that no staging "
                     f"used for {PRUNE_AFTER_S // 86400} days, " if prunable else "")
            raise StageFailed(f"host {host.name}: staging needs {need:,} bytes in {cache} ("
                              + ", ".join(f"{r} {s['missing_bytes']:,}" for r, s in status.items())
                              + f"), which has {free:,} free: nothing sent; {prune}free space there, or give it a "
                              f"workdir on a larger disk", retry=Retry.NEVER)
        got: dict[str, dict] = {}
        if s3 := [r for r in roles if sources[r].from_s3]:
            timeout = BASE_TIMEOUT_S + sum(status[r]["missing_bytes"] for r in s3) / MIN_RATE
            tuning = ["--threads", str(threads), "--part-mib", str(part_mib)]
            got.update(zip(s3, _fetch(host, [sources[r] for r in s3], bundle_sha256, [manifests[r] for r in s3],
                                      access, timeout, nonce, tuning)))
        if sent := [r for r in roles if not sources[r].from_s3]:
            got.update(_send(host, {r: sources[r] for r in sent}, bundle_sha256, {r: manifests[r] for r in sent},
                             {r: status[r]["offsets"] for r in sent}))
    finally:
        _quietly(host, "rm -f " + " ".join(quote(m) for m in manifests.values()))
    for role in roles:
        one = got[role]
        staged.paths[role] = one["view"]
        staged.digests[role] = one["digests"]
        staged.sent_bytes += one["sent_bytes"]
        staged.resumed_bytes += one["resumed_bytes"]
        staged.kept_files += one["kept_files"]
        if log is not None:
            log.info("host %s: %s %s staged at %s: %s byte(s) sent, %s resumed, %d file(s) already there",
                     host.name, role, sources[role].uri, one["view"], f"{one['sent_bytes']:,}",
                     f"{one['resumed_bytes']:,}", one["kept_files"])
    staged.seconds = round(time.monotonic() - started, 3)
    return staged


def _fetch(host: Host, sources: list[Source], bundle_sha256: str, manifests: list[str], access: S3Access,
           timeout: float, nonce: str, extra: list[str]) -> list[dict]:
    """`hsextract stage fetch` on the host: it GETs what it lacks from S3 with the run's credentials."""
    if access.endpoint_url:
        extra = [*extra, "--s3-endpoint", access.endpoint_url]
    creds = f"{cache_dir(host.spec.workdir)}/manifests/credentials-{nonce}"
    with access_on(host, access, creds, BASE_TIMEOUT_S) as (args, env):
        fetched = _run_stage(host, env + _stage_cmd(host, bundle_sha256, "fetch", manifests, [*extra, *args]),
                             timeout, " and ".join(s.uri for s in sources))
        return cast(list[dict], fetched)  # fetch prints one object per source


def _local_copy(host: Host, source: Source, entry: SourceFile) -> Path:
    """The orchestrator's copy of a manifest entry of an orchestrator: source, as its manifest says it is
    (StageFailed, not retried, when it is gone or changed)."""
    assert source.local is not None  # only orchestrator: sources are sent
    local = Path(source.local) if source.manifest.kind == "file" else Path(source.local) / entry.path
    try:
        size = local.stat().st_size
    except OSError as exc:
        raise StageFailed(f"host {host.name}: staging {source.uri}: {local}: {exc.strerror or exc}",
                          retry=Retry.NEVER) from None
    if size != entry.size:
        raise StageFailed(f"host {host.name}: staging {source.uri}: {local} changed since its manifest was "
                          f"made ({size:,} bytes, manifest {entry.size:,})", retry=Retry.NEVER)
    return local


def _send(host: Host, sources: dict[str, Source], bundle_sha256: str, manifests: dict[str, str],
          offsets: dict[str, dict[str, int]]) -> dict[str, dict]:
    """Send each file the host lacks over SFTP into its partial file (from where the last send stopped), then
    one `hsextract stage place` verifies them there."""
    cache = Cache(cache_dir(host.spec.workdir))
    files: list[tuple[str | Path, str, int]]  # (local, partial file on the host, offset)
    sent, resumed, total, files = {}, {}, 0, []
    for role, source in sources.items():
        sent[role] = resumed[role] = 0
        for entry in source.manifest.files:
            if entry.path not in offsets[role]:
                continue
            offset, local = offsets[role][entry.path], _local_copy(host, source, entry)
            if offset < entry.size:
                files.append((local, str(cache.partial(entry, source.manifest.source)), offset))
                sent[role] += entry.size - offset
            resumed[role] += offset
            total += entry.size
    what = " and ".join(s.uri for s in sources.values())
    timeout = BASE_TIMEOUT_S + total / MIN_RATE
    if not files:
        placed = _run_stage(host, _stage_cmd(host, bundle_sha256, "place", list(manifests.values())), timeout, what)
    else:  # the host hashes each file as it arrives (`place --follow`) while one SFTP session sends them all
        nonce = uuid.uuid4().hex[:12]
        abort = f"{cache.root}/partial/{nonce}.abort"
        command = _stage_cmd(host, bundle_sha256, "place", list(manifests.values()), ["--follow", nonce])
        box: dict = {}

        def follow():
            try:
                with _side(host) as other:
                    box["placed"] = _run_stage(other, command, timeout, what)
            except BaseException as exc:  # re-raised below
                box["error"] = exc

        follower = threading.Thread(target=follow, daemon=True, name=f"stage-follow-{host.name}")
        follower.start()
        try:
            host.append_files(files, BASE_TIMEOUT_S + sum(sent.values()) / MIN_RATE)
        except BaseException:
            host.run(f"touch {quote(abort)}", BASE_TIMEOUT_S)  # the follower stops at once
            raise
        finally:
            follower.join()
            _quietly(host, f"rm -f {quote(abort)}")
        if "error" in box:
            raise box["error"]
        placed = box["placed"]
    return {role: {**one, "sent_bytes": sent[role], "resumed_bytes": resumed[role]}
            for role, one in zip(sources, placed)}


def _quietly(host: Host, command: str) -> None:
    """A clean-up command whose failure (a link gone) must not hide the error being raised."""
    with contextlib.suppress(HostError):
        host.run(command, BASE_TIMEOUT_S)


@contextlib.contextmanager
def _side(host: Host):
    """A second way to run commands on `host` while a transfer holds the first: its own SSH connection (a
    host's connection may allow one command at a time), or the local host itself."""
    if isinstance(host, SshHost):
        with SshHost(host.spec, host.inventory, host.timeouts) as other:
            yield other
    else:
        yield host


def settle_manifests(sources: dict[str, Source], staged: dict[str, Staged], access: S3Access,
                     log) -> tuple[dict[str, Source], dict[str, str]]:
    """After a staging: for each S3 source that had no manifest, the digests the hosts computed must agree; the
    manifest is then written next to the source. Returns the sources (complete manifests) and {host: why} for
    any host whose copy differs from the others'."""
    odd: dict[str, str] = {}
    out = dict(sources)
    for role, source in sources.items():
        if source.manifest.complete:
            continue
        seen = {h: tuple(sorted(s.digests[role].items())) for h, s in staged.items() if role in s.digests}
        if not seen:
            continue
        (agreed, votes), = Counter(seen.values()).most_common(1)
        for h, digests in seen.items():
            if digests != agreed:
                differ = sorted(p for p, d in digests if dict(agreed).get(p) != d)
                odd[h] = (f"its copy of {source.uri} differs from {votes} other host(s)' in {differ[0]}"
                          + (f" and {len(differ) - 1} more" if len(differ) > 1 else "") + " (a corrupt fetch?)")
        manifest = source.manifest.with_digests(dict(agreed))
        out[role] = Source(role, source.uri, manifest, source.local)
        try:
            where = write_s3_manifest(access.client(), manifest)
            log.info("%s %s: manifest written to %s (%d file(s), digests agreed by %d host(s))", role, source.uri,
                     where, len(manifest.files), votes)
        except Exception as exc:  # a read-only source: the hosts' caches remember the digests anyway
            log.warning("%s %s: manifest not written to %s (%s): the next staging computes the digests again",
                        role, source.uri, manifest_uri(source.uri), exc)
    return out, odd


def orchestrator_cache() -> Path:
    """The orchestrator's own cache of staged inputs (reconcile reads a staged dataset from it)."""
    return Path(os.environ.get("HSEXTRACT_CACHE") or "~/.cache/hsextract").expanduser() / "inputs"


def dataset_here(uri: str, sources: dict[str, Source], access: S3Access) -> str:
    """A path on the orchestrator holding the dataset the workers read for `data=uri`: the path itself, the
    orchestrator: file, or for s3:// a copy in `orchestrator_cache()`, verified against the same manifest."""
    if not is_staged(uri):
        return uri
    source = sources.get("data") or resolve_source("data", uri, access)
    if source.local is not None:
        return source.local
    cache = Cache(orchestrator_cache())
    try:
        fetched, = cache.fetch(access.client(), [source.manifest], "the orchestrator")
        return str(cache.view(source.manifest.with_digests(fetched.digests)))
    except StageError as exc:
        raise ValueError(f"data={uri!r}: reading it for reconcile: {exc}") from None
