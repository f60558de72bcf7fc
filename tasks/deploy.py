"""Push the code bundle to a host and prove it: the host prints the bundle hash and the worker's version;
then check, on the host, what every shard will need (`hsextract check`: model, layers, dataset, output)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from hsextract.errors import Retry
from hsextract.options import WorkerOptions

from .bundle import Bundle
from .commands import bundle_tarball, check_bundle_cmd, env_check_cmd, preflight_cmd, quote, unpack_bundle_cmd
from .failures import Failure, last_line, one_line, said
from .hosts import Host, HostError, connect
from .inventory import Inventory
from .stage import Staged, StageFailed, on_host, stage_host
from .transient import retry_of


class DeployFailed(Exception):
    """The host does not have a provably working copy of the bundle (or, `retry` NEVER, the run's inputs are not
    usable there: a re-run cannot fix that, a person must; NOW: the task tries again at once). The message's first
    line says why; the rest is the evidence (command, what it printed)."""

    def __init__(self, message: str, retry: Retry = Retry.LATER):
        super().__init__(message, retry)
        self.retry = retry

    def __str__(self) -> str:
        return self.args[0].split("\n", 1)[0]

    def __repr__(self) -> str:
        return f"DeployFailed: {self}"

    @property
    def evidence(self) -> str:
        """The whole message: the reason, the command and what it printed."""
        return self.args[0]


@dataclass(frozen=True)
class Deployed:
    """A host proved to hold the bundle: its hash, the worker version it printed, its package versions."""

    host: str
    bundle_sha256: str
    version: str
    environment: str
    skipped: bool
    seconds: float
    staged: Staged | None = None   # the run's inputs staged there (tasks/stage.py), when it stages any


def _proof(host: Host, bundle_sha256: str, python: str, expect_version: str, timeout: float, synthetic: bool):
    """(proved, result): proved when the host printed exactly this bundle's hash and the worker version."""
    result = host.run(check_bundle_cmd(host.spec.workdir, bundle_sha256, python, synthetic), timeout)
    lines = result.stdout.split("\n")  # BUNDLE <hash>, hsextract <version>, then ENV {...} once proved
    proved = (result.ok and len(lines) >= 2 and lines[0] == f"BUNDLE {bundle_sha256}"
              and lines[1] == f"hsextract {expect_version}")
    return proved, result


def _free_space(host: Host, path: str) -> str:
    """'; <N> KiB free on the disk of <path>' (SFTP says only "Failure" when the host's disk is full)."""
    try:
        result = host.run(f"p={quote(path)}; while [ ! -d \"$p\" ]; do p=$(dirname \"$p\"); done; df -Pk \"$p\"", 10)
        fields = result.stdout.strip().splitlines()[-1].split()
        return f"; {int(fields[3]):,} KiB free on the disk of {path} ({fields[5]})" if result.ok else ""
    except (HostError, IndexError, ValueError):
        return ""


def deploy_host(host: Host, bundle: Bundle, version: str, timeout: float = 120.0, synthetic: bool = False) -> Deployed:
    """Prove `host` holds `bundle` and can import the worker's packages (`synthetic`: the synthetic worker's,
    which need no torch), pushing the bundle first when it does not; DeployFailed naming the host and what it
    printed."""
    started = time.monotonic()
    python = host.spec.python
    proved, check = _proof(host, bundle.sha256, python, version, timeout, synthetic)
    skipped = proved
    if not proved:
        nonce = uuid.uuid4().hex[:12]
        tarball = bundle_tarball(host.spec.workdir, bundle.sha256, nonce)
        try:
            host.put(bundle.data, tarball, timeout, mode=0o640)
        except HostError as exc:
            raise DeployFailed(f"host {host.name}: uploading the bundle ({len(bundle.data):,} bytes) to {tarball} "
                               f"failed: {exc.reason}{_free_space(host, host.spec.workdir)}", exc.retry) from None
        unpacked = host.run(unpack_bundle_cmd(host.spec.workdir, bundle.sha256, nonce), timeout)
        if not unpacked.stdout.startswith(f"SHA256 {bundle.sha256}\n") or not unpacked.ok:
            raise DeployFailed(f"host {host.name}: wrong bundle hash or unpack failed: {said(unpacked)}\n"
                               f"(expected sha256 {bundle.sha256}); " + unpacked.describe())
        proved, check = _proof(host, bundle.sha256, python, version, timeout, synthetic)
        if not proved:
            raise DeployFailed(f"host {host.name}: `{python} -m hsextract --version` did not prove the bundle: "
                               f"{said(check)}\n"
                               f"(expected 'BUNDLE {bundle.sha256}' and 'hsextract {version}'); " + check.describe())
    if skipped and (line := next((ln for ln in check.stdout.splitlines() if ln.startswith("ENV ")), None)):
        return Deployed(host.name, bundle.sha256, version, line[4:], True, round(time.monotonic() - started, 3))
    env = host.run(env_check_cmd(python, host.spec.workdir, bundle.sha256, synthetic), timeout)
    line = next((ln for ln in env.stdout.splitlines() if ln.startswith("ENV ")), None)
    if not env.ok or line is None:
        what = "the synthetic worker" if synthetic else "the worker's packages (torch, transformers, safetensors)"
        raise DeployFailed(f"host {host.name}: its python cannot import {what}: {said(env)}\n" + env.describe())
    return Deployed(host.name, bundle.sha256, version, line[4:], skipped, round(time.monotonic() - started, 3))


def preflight_host(host: Host, bundle_sha256: str, options: list[str], timeout: float = 120.0) -> dict:
    """`hsextract check` on `host` with a shard's worker `options`: what it found (model type, layers...);
    DeployFailed (Retry.NEVER) naming the problem when a shard could not run there."""
    result = host.run(preflight_cmd(host.spec.workdir, bundle_sha256, host.spec.python, options), timeout)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("CHECK ")), None)
    if result.ok and line is not None:
        return json.loads(line[6:])
    problem = last_line(result.stderr).removeprefix("hsextract: ")
    if result.returncode == 2 and problem:
        raise DeployFailed(f"host {host.name}: {problem}\npreflight check: {result.describe()}", Retry.NEVER)
    raise DeployFailed(f"host {host.name}: the preflight check (`hsextract check`) gave no verdict: "
                       f"{said(result)}\n" + result.describe())


def _retry_now(task, task_run, state) -> bool:
    try:
        state.result()
    except (DeployFailed, HostError) as exc:
        return exc.retry is Retry.NOW
    except Exception as exc:
        return retry_of(exc) is Retry.NOW
    return False


@task(name="stage", cache_policy=NO_CACHE, task_run_name="stage-{host_name}")
def stage(host_name: str, host: Host, sources: dict, bundle_sha256: str, access) -> Staged:
    """Task: the run's staged inputs (tasks/stage.py) onto the host, verified; StageFailed names the file."""
    return stage_host(host, sources, bundle_sha256, access, get_run_logger())


@task(name="deploy", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=_retry_now,
      task_run_name="deploy-{host_name}")
def deploy(host_name: str, inventory: Inventory, bundle: Bundle, version: str, checks: WorkerOptions | None = None,
           sources: dict | None = None, access=None) -> Deployed:
    """Task: `deploy_host` over a connection of its own, then the staged inputs (a `stage` task: `sources`, with
    the run's S3 `access`), then `preflight_host` with the worker options `checks` (when given) on the staged
    paths; a failure that says Retry.NOW is tried again at once, a mistake in the inputs (NEVER) is not."""
    with connect(inventory.host(host_name), inventory) as host:
        deployed = deploy_host(host, bundle, version, synthetic=checks is not None and checks.synthetic is not None)
        staged = None
        if sources:
            try:
                staged = stage(host_name, host, sources, bundle.sha256, access)
            except StageFailed as exc:
                raise DeployFailed(f"{exc}\n{exc.evidence}", exc.retry) from None
            deployed = replace(deployed, staged=staged)
        found = preflight_host(host, bundle.sha256, on_host(checks, staged).argv()) if checks is not None else {}
    get_run_logger().info("host %s: bundle %s %s, %s, %s (%.1fs)%s", host_name, bundle.sha256[:12],
                          "already in place" if deployed.skipped else "pushed", deployed.version,
                          deployed.environment, deployed.seconds,
                          f"; checked: {found['model_type']} with {found['num_layers']} layers, layers "
                          f"{found['layers']}, dataset {found['data_bytes']:,} bytes" if found else "")
    return deployed


def deploy_hosts(inventory: Inventory, bundle: Bundle, version: str, checks: WorkerOptions | None = None,
                 sources: dict | None = None, access=None) -> tuple[set[str], dict[str, Failure], dict[str, Staged]]:
    """Deploy to every host concurrently (a `deploy` task each: the bundle, the staged `sources`, a check of a
    shard's worker options `checks` there): (healthy host names, {"host X": Failure} for the others, whose
    shards then run on the healthy ones, {host: Staged} where inputs were staged)."""
    futures = {h.name: deploy.submit(h.name, inventory, bundle, version, checks, sources, access)
               for h in inventory.hosts}
    healthy, failures, staged = set(), {}, {}
    for name, future in futures.items():
        future.wait()
        if future.state.is_completed():
            healthy.add(name)
            if (got := future.result().staged) is not None:
                staged[name] = got
        else:
            failures[f"host {name}"] = _failure(name, future.state)
    return healthy, failures, staged


def _failure(name: str, state) -> Failure:
    """The host's `Failure` from its failed task's state: its first line is the reason."""
    try:
        state.result()
    except DeployFailed as exc:
        return Failure(name, one_line(str(exc).removeprefix(f"host {name}: ")), exc.evidence, exc.retry)
    except Exception as exc:
        text = str(exc) or type(exc).__name__
        return Failure(name, one_line(text.removeprefix(f"host {name}: ")), text)
    return Failure(name, one_line(state.message or state.name))
