"""The `extract` flow: deploy -> launch -> supervise, one shard per GPU slot, concurrently.

Ends Completed only when every requested shard is done; otherwise Failed, naming each failed shard,
its host and the reason. Calling it again with the same `run_name` and `output` continues the run:
complete shards are not redone (the worker resumes by sample id) and running ones are adopted.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextvars
import hashlib
import re
import sys
import threading
import time
from collections import deque
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `prefect deployment run` starts flows with the project root elsewhere
    sys.path.insert(0, str(ROOT))

from tasks.bundle import build_bundle  # noqa: E402
from tasks.deploy import deploy  # noqa: E402
from tasks.inventory import Inventory, InventoryError, load_inventory, parse_inventory  # noqa: E402
from tasks.reconcile import reconcile  # noqa: E402
from tasks.shards import Policy, ShardJob, forget_credentials, launch, supervise  # noqa: E402
from tasks.credentials import load_access  # noqa: E402
from hsextract.journal import shard_dir_name  # noqa: E402
from hsextract.upload import split_uri  # noqa: E402


class RunIncomplete(Exception):
    """Some requested shard is not done; the message lists every failure with host and reason."""


def worker_version() -> str:
    text = (ROOT / "src" / "hsextract" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def resolve_inventory(hosts: str) -> Inventory:
    """A YAML path, or the name of a HostInventory block holding the same YAML."""
    if Path(hosts).expanduser().is_file():
        return load_inventory(hosts)
    try:
        from tasks.blocks import HostInventory

        block = HostInventory.load(hosts)
    except Exception as exc:
        raise InventoryError(f"hosts={hosts!r}: neither an inventory file nor a HostInventory block ({exc})") from None
    return parse_inventory(block.yaml, f"block {hosts}")


def local_output(output: str) -> str | None:
    """The directory of a file:// (or absolute path) output; None for s3://bucket/prefix."""
    if output.startswith("file://"):
        return output.removeprefix("file://")
    if output.startswith("/"):
        return output
    if output.startswith("s3://"):
        split_uri(output)  # a bucket is required
        return None
    raise ValueError(f"output={output!r}: use file:///absolute/path or s3://bucket/prefix")


def default_run_name(output: str) -> str:
    return "run-" + hashlib.sha256(output.encode()).hexdigest()[:10]


def worker_args(model, data, out, layers, max_length, token_budget, device, heartbeat_s,
                s3_endpoint: str | None = None) -> tuple[str, ...]:
    args = ["--model", model, "--data", data, "--out", out, "--layers", layers,
            "--token-budget", str(token_budget), "--device", device, "--progress", "log",
            "--heartbeat-interval", str(heartbeat_s)]
    if max_length is not None:
        args += ["--max-length", str(max_length)]
    if s3_endpoint:
        args += ["--s3-endpoint", s3_endpoint]
    return tuple(args)


def _ends_done(journal: bytes) -> bool:
    return journal.rstrip().rsplit(b"\n", 1)[-1].startswith(b'{"kind":"done"')


def _done_locally(out_dir: str, num_shards: int) -> set[int]:
    """Shards whose journal (visible from here) ends with `done`: skipped without touching a host."""
    done = set()
    for shard in range(num_shards):
        journal = Path(out_dir) / f"shard-{shard:05d}-of-{num_shards:05d}" / "journal.jsonl"
        if journal.is_file() and _ends_done(journal.read_bytes()):
            done.add(shard)
    return done


def _done_in_store(output: str, client, num_shards: int) -> set[int]:
    """Shards whose journal mirrored in the store ends with `done` (a mirror names only verified files)."""
    from botocore.exceptions import ClientError

    bucket, prefix = split_uri(output)
    done = set()
    for shard in range(num_shards):
        key = f"{prefix}/{shard_dir_name(shard, num_shards)}/journal.jsonl".lstrip("/")
        try:
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                continue
            raise
        if _ends_done(body):
            done.add(shard)
    return done


@flow(name="extract", task_runner=ThreadPoolTaskRunner(max_workers=256), validate_parameters=True)
def extract(
    model: str,
    data: str,
    output: str,
    hosts: str,
    layers: str = "dflash:5",
    num_shards: int | None = None,
    shards: list[int] | None = None,
    run_name: str | None = None,
    aws_credentials: str | None = None,
    max_length: int | None = None,
    token_budget: int = 8192,
    device: str = "auto",
    heartbeat_interval_s: float = 2.0,
    launch_timeout_s: float = 60.0,
    stall_timeout_s: float = 60.0,
    poll_interval_s: float = 2.0,
    host_timeout_s: float = 60.0,
    verify_checksums: bool = False,
):
    log = get_run_logger()
    inventory = resolve_inventory(hosts)
    out_dir = local_output(output)
    upload = out_dir is None
    access = load_access(aws_credentials)  # fails here, before any launch, on a missing or bad block
    slots = inventory.slots
    num_shards = num_shards or len(slots)
    requested = sorted(set(shards)) if shards is not None else list(range(num_shards))
    bad = [s for s in requested if not 0 <= s < num_shards]
    if bad:
        raise ValueError(f"shards={bad}: out of range for num_shards={num_shards}")
    run = run_name or default_run_name(output)
    already: set[int] = set()
    client = access.client() if upload else None
    if shards is None:
        try:
            already = _done_in_store(output, client, num_shards) if upload else _done_locally(out_dir, num_shards)
        except Exception as exc:  # the orchestrator may not reach the store; the workers resume by id anyway
            log.warning("run %s: cannot read the journals in %s from here (%s): every shard is launched, and "
                        "each skips what its journal already holds", run, output, exc)
    todo = deque(s for s in requested if s not in already)
    log.info("run %s: %d shard(s) requested, %d already complete, %d GPU slot(s) on %d host(s)",
             run, len(requested), len(already), len(slots), len(inventory.hosts))
    policy = Policy(launch_timeout_s=launch_timeout_s, poll_interval_s=poll_interval_s,
                    stall_timeout_s=stall_timeout_s, host_timeout_s=host_timeout_s)

    bundle = build_bundle(ROOT)
    healthy, failures = deploy_hosts(inventory, bundle, worker_version()) if todo else (set(), {})
    args = worker_args(model, data, output if upload else out_dir, layers, max_length, token_budget, device,
                       heartbeat_interval_s, access.endpoint_url if upload else None)
    env = (("AWS_DEFAULT_REGION", access.region),) if upload and access.region else ()

    def job_on(slot: tuple[str, int], shard: int) -> ShardJob:
        spec = inventory.host(slot[0])
        return ShardJob(run, shard, num_shards, slot[0], slot[1], spec.workdir, spec.python, bundle.sha256,
                        out_dir or "", args, upload=upload, aws_credentials=aws_credentials if upload else None,
                        env=env)

    free = deque(slot for slot in slots if slot[0] in healthy)
    outcomes, shard_failures = run_shards(todo, free, job_on, inventory, policy)
    outcomes.update({s: "done (already complete)" for s in already})
    failures.update(shard_failures)
    summary = {"run_name": run, "output": output, "num_shards": num_shards,
               "shards": {str(s): outcomes.get(s, "failed") for s in requested}}
    if failures:
        text = "\n".join(f"- {where}: {why}" for where, why in sorted(failures.items()))
        raise RunIncomplete(f"run {run}: {len(failures)} failure(s), shards {summary['shards']}:\n{text}")
    log.info("run %s: all %d requested shard(s) complete", run, len(requested))
    if (upload or Path(out_dir).is_dir()) and Path(data).is_file():
        checked = reconcile(output if upload else out_dir, data, num_shards, verify_checksums,
                            artifact_key=_artifact_key(run), aws_credentials=aws_credentials)
        summary["reconcile"] = checked
        if set(checked["shards_to_rerun"]) & set(requested):
            raise RunIncomplete(f"run {run}: reconcile found {checked['missing']} sample(s) missing "
                                f"({checked['missing_objects']} object(s) missing, {checked['corrupt_objects']} "
                                f"corrupt); re-run shards {checked['shards_to_rerun']} (their journals now say "
                                f"which files were lost, so a re-run redoes exactly those samples)")
    else:
        log.warning("run %s: reconcile skipped: the output or the dataset (%s) is not visible from the "
                    "orchestrator (file:// output on remote hosts, or a dataset path only the hosts have)", run, data)
    return summary


def _artifact_key(run: str) -> str:
    return "reconcile-" + re.sub(r"[^a-z0-9-]", "-", run.lower())


def deploy_hosts(inventory: Inventory, bundle, version: str) -> tuple[set[str], dict[str, str]]:
    """Deploy to every host concurrently: (healthy host names, {"host X": why} for the others)."""
    futures = {h.name: deploy.submit(h.name, inventory, bundle, version) for h in inventory.hosts}
    healthy, failures = set(), {}
    for name, future in futures.items():
        future.wait()
        if future.state.is_completed():
            healthy.add(name)
        else:
            failures[f"host {name}"] = _message(future.state)
    return healthy, failures


def run_shards(todo: deque, free: deque, job_on, inventory: Inventory, policy: Policy):
    """Launch then supervise each shard on a free GPU slot; a slot takes the next shard when it frees up.

    Each shard has a driver thread (with the flow's context) that calls the launch task, then the
    supervise task, directly: a failed launch raises in its driver, so no task is ever left Pending or
    NotReady, and results never queue behind one scheduler thread. Returns ({shard: "done"}, {"shard N": why}).
    """
    if not todo:
        return {}, {}
    if not free:
        return {}, {f"shard {s}": "no healthy host to run it on" for s in todo}
    outcomes, failures = {}, {}
    log = get_run_logger()
    first_wave, started = min(len(todo), len(free)), time.monotonic()
    proved, lock = [0], threading.Lock()

    def drive(job: ShardJob) -> dict:
        try:
            launched = launch(job, inventory, policy)
            with lock:
                proved[0] += 1
                if proved[0] == first_wave:
                    log.info("all %d shard(s) of the first wave verified running, %.1fs after the first launch",
                             first_wave, time.monotonic() - started)
            return supervise(job, launched, inventory, policy)
        finally:
            try:
                forget_credentials(job, inventory)
            except Exception as exc:  # the verdict stands; say the file may still be there
                log.warning("%s: credentials file %s may remain on the host: %s", job.label,
                            job.credentials_path, exc)

    active: dict[cf.Future, tuple[ShardJob, tuple[str, int]]] = {}
    with cf.ThreadPoolExecutor(max_workers=len(free), thread_name_prefix="shard") as pool:
        while todo or active:
            while todo and free:
                slot = free.popleft()
                job = job_on(slot, todo.popleft())
                active[pool.submit(contextvars.copy_context().run, drive, job)] = (job, slot)
            done, _ = cf.wait(list(active), return_when=cf.FIRST_COMPLETED)
            for future in done:
                job, slot = active.pop(future)
                free.append(slot)
                try:
                    future.result()
                    outcomes[job.shard] = "done"
                except Exception as exc:  # the task's own error: host, shard, command, output
                    failures[f"shard {job.shard}"] = str(exc) or type(exc).__name__
    return outcomes, failures


def _message(state) -> str:
    try:
        state.result()
    except Exception as exc:
        return str(exc)
    return state.message or state.name
