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
import threading
import time
from collections import deque
from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger
from prefect.events import emit_event
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

ROOT = Path(__file__).resolve().parents[1]  # the checkout: what the code bundle pushed to the hosts is made of

from tasks.board import Board, read_table, run_key
from tasks.bundle import build_bundle
from tasks.commands import RUN_NAME_PATTERN
from tasks.deploy import deploy
from tasks.inventory import Inventory, InventoryError, load_inventory, parse_inventory
from tasks.orphans import close_orphaned_task_runs
from tasks.reconcile import reconcile
from tasks.shards import Policy, ShardJob, forget_credentials, launch, supervise
from tasks.credentials import load_access
from hsextract.store import NoSuchBucket, open_store, scan, split_uri


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
                s3_endpoint: str | None = None, dtype: str = "auto", out_dtype: str = "auto",
                upload_from: str = "disk", upload_memory_gb: float = 8.0, spool_high_gb: float = 64.0,
                spool_low_gb: float = 32.0, confine: str = "auto") -> tuple[str, ...]:
    args = ["--model", model, "--data", data, "--out", out, "--layers", layers,
            "--token-budget", str(token_budget), "--device", device, "--dtype", dtype, "--out-dtype", out_dtype,
            "--progress", "log", "--confine", confine,
            "--heartbeat-interval", str(heartbeat_s)]
    if max_length is not None:
        args += ["--max-length", str(max_length)]
    if s3_endpoint:
        args += ["--s3-endpoint", s3_endpoint, "--spool-high-gb", f"{spool_high_gb:g}",
                 "--spool-low-gb", f"{spool_low_gb:g}"]
    if upload_from != "disk":
        args += ["--upload-from", upload_from, "--upload-memory-gb", f"{upload_memory_gb:g}"]
    return tuple(args)


def _done_shards(store, num_shards: int, run: str, log) -> set[int]:
    """Shards of `num_shards` whose journal (in the output, as far as the orchestrator can read it) ends with
    `done`: skipped without touching a host. A missing bucket stops the run here, before any launch."""
    try:
        state = scan(store)
    except NoSuchBucket as exc:
        raise ValueError(f"output={store.uri!r}: {exc}") from None
    except Exception as exc:  # the orchestrator may not reach the store; the workers resume by id anyway
        log.warning("run %s: cannot read the journals in %s from here (%s): every shard is launched, and "
                    "each skips what its journal already holds", run, store.uri, exc)
        return set()
    return {shard for shard in range(num_shards) if state.done(shard, num_shards)}


LayerSpec = Annotated[str, Field(pattern=r"^\s*(dflash:[1-9]\d*|eagle3|\d+(\s*,\s*\d+)*)\s*$",
                                  description="dflash:N, eagle3, or layer ids like 1,16,31")]
OutputUri = Annotated[str, Field(pattern=r"^(file:///|/|s3://[^/\s]+)",
                                 description="file:///absolute/path or s3://bucket/prefix")]
Positive = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0)]
#: every parameter of `extract`, in order: an automated re-run passes all of them on (deployments/qwen.py)
PARAMETERS = ("model", "data", "output", "hosts", "layers", "num_shards", "shards", "run_name", "aws_credentials",
              "max_length", "dtype", "out_dtype", "upload_from", "upload_memory_gb", "token_budget", "device",
              "heartbeat_interval_s", "launch_timeout_s", "stall_timeout_s", "poll_interval_s", "host_timeout_s",
              "verify_checksums", "max_attempts", "reset_attempts", "rerun_depth", "max_reruns", "status_interval_s",
              "progress_timeout_s", "spool_high_gb", "spool_low_gb", "confine")


@flow(name="extract", task_runner=ThreadPoolTaskRunner(max_workers=256), validate_parameters=True)
def extract(
    model: Annotated[str, Field(min_length=1)],
    data: Annotated[str, Field(min_length=1)],
    output: OutputUri,
    hosts: Annotated[str, Field(min_length=1)],
    layers: LayerSpec = "dflash:5",
    num_shards: Positive | None = None,
    shards: list[Annotated[int, Field(ge=0)]] | None = None,
    run_name: Annotated[str, Field(pattern=RUN_NAME_PATTERN, description="letters, digits, . _ - (a directory "
                                   "name on every host: no path, spaces or shell characters)")] | None = None,
    aws_credentials: str | None = None,
    max_length: Positive | None = None,
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto",
    out_dtype: Literal["auto", "fp8_e4m3"] = "auto",
    upload_from: Literal["disk", "memory"] = "disk",
    upload_memory_gb: Annotated[float, Field(gt=0)] = 8.0,
    token_budget: Positive = 8192,
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")] = "auto",
    heartbeat_interval_s: Seconds = 2.0,
    launch_timeout_s: Seconds = 60.0,
    stall_timeout_s: Seconds = 60.0,
    poll_interval_s: Seconds = 2.0,
    host_timeout_s: Seconds = 60.0,
    verify_checksums: bool = False,
    max_attempts: Positive = 3,
    reset_attempts: bool = False,
    rerun_depth: Annotated[int, Field(ge=0)] = 0,
    max_reruns: Annotated[int, Field(ge=0)] = 10,
    status_interval_s: Seconds = 15.0,
    progress_timeout_s: Seconds = 1800.0,
    spool_high_gb: Annotated[float, Field(gt=0)] = 64.0,
    spool_low_gb: Annotated[float, Field(gt=0)] = 32.0,
    confine: Literal["auto", "on", "off"] = "auto",
):
    """Extract hidden states of `model` over `data` on the hosts of `hosts`, one shard per GPU, into `output`.

    A shard that failed `max_attempts` times in this run (counted across runs of the same `run_name`) is not
    launched again until `reset_attempts=true`. A failed run with shards under the cap emits
    `extract.run.incomplete`, which the re-run automation turns into a run of exactly those shards;
    `rerun_depth` counts such automated re-runs and `max_reruns` bounds them.

    A shard heartbeating but with no sample finished and no byte uploaded for `progress_timeout_s` (a hung
    GPU, a dead store) is killed as stalled. With an s3:// output a worker's spool waits above
    `spool_high_gb` until uploads bring it under `spool_low_gb`. `confine` ("auto", "on", "off"): each worker
    may write only beneath its own shard's directories (Linux Landlock; "auto" when the host's kernel has it).
    """
    params = {name: value for name, value in locals().items() if name in PARAMETERS}  # for a re-run request
    log = get_run_logger()
    run = run_name or default_run_name(output)
    if rerun_depth > max_reruns:
        raise RunIncomplete(f"run {run}: this is automated re-run {rerun_depth}, over max_reruns={max_reruns}: "
                            f"not run. Look at the failures of the earlier runs, then start it again by hand")
    _close_orphans(run, log)
    inventory = resolve_inventory(hosts)
    out_dir = local_output(output)
    upload = out_dir is None
    if spool_low_gb > spool_high_gb:
        raise ValueError(f"spool_low_gb={spool_low_gb:g} is over spool_high_gb={spool_high_gb:g}: extraction "
                         f"pauses above the high-water mark and resumes below the low one")
    if upload_from == "memory" and not upload:
        raise ValueError(f"upload_from='memory' needs an s3:// output, not output={output!r}: files go from "
                         f"memory straight to the store, so there is nothing to upload to on a local path")
    access = load_access(aws_credentials)  # fails here, before any launch, on a missing or bad block
    slots = inventory.slots
    num_shards = params["num_shards"] = num_shards or len(slots)
    requested = sorted(set(shards)) if shards is not None else list(range(num_shards))
    bad = [s for s in requested if not 0 <= s < num_shards]
    if bad:
        raise ValueError(f"shards={bad}: out of range for num_shards={num_shards}")
    store = open_store(output, client=access.client)
    already = _done_shards(store, num_shards, run, log) if shards is None else set()
    prior = _read_table(run, num_shards, log)
    if reset_attempts:
        prior = {s: {**row, "failed_attempts": 0} for s, row in prior.items()}
    board = Board(run, num_shards, requested, status_interval_s, related=_related_resources(), prior=prior)
    capped = {s for s in requested if s not in already and board.failed_attempts(s) >= max_attempts}
    todo = deque(s for s in requested if s not in already and s not in capped)
    log.info("run %s: %d shard(s) requested, %d already complete, %d at the attempt cap, %d GPU slot(s) on "
             "%d host(s)", run, len(requested), len(already), len(capped), len(slots), len(inventory.hosts))
    policy = Policy(launch_timeout_s=launch_timeout_s, poll_interval_s=poll_interval_s,
                    stall_timeout_s=stall_timeout_s, host_timeout_s=host_timeout_s,
                    command_timeout_s=min(Policy.command_timeout_s, host_timeout_s),  # a probe waits no longer
                    progress_timeout_s=progress_timeout_s)

    failures: dict[str, str] = {}
    with board:
        for s in sorted(already):
            board.set_state(s, "complete", "already complete")
        for s in sorted(capped):
            why = (f"attempt cap reached: failed {board.failed_attempts(s)} time(s) (max_attempts={max_attempts}), "
                   f"last on host {board.last_failed_host(s) or '?'}: {board.last_error(s) or '?'}; not launched "
                   f"again. Fix the cause, then run with reset_attempts=true")
            board.set_state(s, "capped", why)
            failures[f"shard {s}"] = why
        bundle = build_bundle(ROOT)
        healthy, host_failures = deploy_hosts(inventory, bundle, worker_version()) if todo else (set(), {})
        failures.update(host_failures)
        args = worker_args(model, data, output if upload else out_dir, layers, max_length, token_budget, device,
                           heartbeat_interval_s, access.endpoint_url if upload else None, dtype, out_dtype,
                           upload_from, upload_memory_gb, spool_high_gb, spool_low_gb, confine)
        env = (("AWS_DEFAULT_REGION", access.region),) if upload and access.region else ()

        def job_on(slot: tuple[str, int], shard: int) -> ShardJob:
            spec = inventory.host(slot[0])
            return ShardJob(run, shard, num_shards, slot[0], slot[1], spec.workdir, spec.python, bundle.sha256,
                            out_dir or "", args, upload=upload,
                            aws_credentials=aws_credentials if upload else None, env=env)

        free = deque(slot for slot in slots if slot[0] in healthy)
        outcomes, shard_failures = run_shards(todo, free, job_on, inventory, policy, board)
        failures.update(shard_failures)
    outcomes.update({s: "done (already complete)" for s in already})
    outcomes.update({s: "capped" for s in capped})
    summary = {"run_name": run, "output": output, "num_shards": num_shards,
               "shards": {str(s): outcomes.get(s, "failed") for s in requested}}
    if failures:
        failed = [s for s in requested if summary["shards"][str(s)] not in ("done", "done (already complete)")]
        rerun = [s for s in failed if board.failed_attempts(s) < max_attempts]
        note = _request_rerun(run, params, rerun, failed, rerun_depth, max_reruns, log)
        text = "\n".join(f"- {where}: {why}" for where, why in sorted(failures.items()))
        raise RunIncomplete(f"run {run}: {len(failures)} failure(s), shards {summary['shards']}; {note}:\n{text}")
    log.info("run %s: all %d requested shard(s) complete", run, len(requested))
    if (upload or Path(out_dir).is_dir()) and Path(data).is_file():
        checked = reconcile(store, data, num_shards, verify_checksums, artifact_key=_artifact_key(run))
        summary["reconcile"] = checked
        redo = sorted(set(checked["shards_to_rerun"]) & set(requested))
        if redo:
            note = _request_rerun(run, params, redo, redo, rerun_depth, max_reruns, log)
            raise RunIncomplete(f"run {run}: reconcile found {checked['missing']} sample(s) missing "
                                f"({checked['missing_objects']} object(s) missing, {checked['corrupt_objects']} "
                                f"corrupt); re-run shards {checked['shards_to_rerun']} (their journals now say "
                                f"which files were lost, so a re-run redoes exactly those samples); {note}")
    else:
        log.warning("run %s: reconcile skipped: the output or the dataset (%s) is not visible from the "
                    "orchestrator (file:// output on remote hosts, or a dataset path only the hosts have)", run, data)
    return summary


def _read_table(run: str, num_shards: int, log) -> dict:
    try:
        return read_table(run, num_shards)
    except Exception as exc:  # no record is not a reason to stop; say the cap starts from zero
        log.warning("run %s: earlier attempts unreadable (%s): the attempt cap counts from this run", run, exc)
        return {}


def _close_orphans(run: str, log) -> None:
    """Task runs that a dead earlier run of `run` left Running are set Crashed (this run adopts their shards)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    try:
        with get_client(sync_client=True) as client:
            closed = close_orphaned_task_runs(
                client, run, lambda p: p.get("run_name") or default_run_name(str(p.get("output"))),
                ctx.flow_run.id if ctx and ctx.flow_run else None)
    except Exception as exc:  # bookkeeping: never a reason to stop the run
        log.warning("run %s: could not close the task runs earlier runs left Running: %s", run, exc)
        return
    if closed:
        log.info("run %s: set Crashed %d task run(s) a dead earlier run left Running: %s", run, len(closed),
                 ", ".join(closed))


def _related_resources() -> list[dict]:
    """The flow run, its flow and deployment: what `extract.*` events are related to (automations match these)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    if run is None:
        return []
    related = [{"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.role": "flow-run",
                "prefect.resource.name": run.name or ""},
               {"prefect.resource.id": f"prefect.flow.{run.flow_id}", "prefect.resource.role": "flow",
                "prefect.resource.name": "extract"}]
    if run.deployment_id:
        related.append({"prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
                        "prefect.resource.role": "deployment"})
    return related


RERUN_EVENT = "extract.run.incomplete"


def _request_rerun(run: str, params: dict, rerun: list[int], failed: list[int], depth: int, max_reruns: int,
                   log) -> str:
    """Emit `extract.run.incomplete` asking for a run of `rerun` (the re-run automation acts on it); says what."""
    capped = sorted(set(failed) - set(rerun))
    if not rerun:
        return (f"no re-run requested: shard(s) {capped} are at the attempt cap" if capped
                else "no re-run requested")
    if depth >= max_reruns:
        return f"no re-run requested: {depth} automated re-run(s) already, max_reruns={max_reruns}"
    # num_shards pinned: shard i means the same samples in the re-run even if the inventory changed meanwhile
    parameters = {**params, "run_name": run, "shards": rerun, "rerun_depth": depth + 1, "reset_attempts": False}
    emit_event(RERUN_EVENT, resource={"prefect.resource.id": f"hsextract.run.{run_key(run)}",
                                      "prefect.resource.name": run, "hsextract.run": run},
               related=_related_resources(),
               payload={"run_name": run, "rerun": rerun, "capped": capped, "parameters": parameters})
    log.info("run %s: asked for a re-run of shard(s) %s (automated re-run %d)%s", run, rerun, depth + 1,
             f"; shard(s) {capped} are at the attempt cap" if capped else "")
    return (f"re-run of shard(s) {rerun} requested ({RERUN_EVENT}, re-run {depth + 1} of at most {max_reruns})"
            + (f"; shard(s) {capped} at the attempt cap" if capped else ""))


def _artifact_key(run: str) -> str:
    return "reconcile-" + run_key(run)


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


def run_shards(todo: deque, free: deque, job_on, inventory: Inventory, policy: Policy, board: Board):
    """Launch then supervise each shard on a free GPU slot; a slot takes the next shard when it frees up.

    Each shard has a driver thread (with the flow's context) that calls the launch task, then the
    supervise task, directly: a failed launch raises in its driver, so no task is ever left Pending or
    NotReady, and results never queue behind one scheduler thread. A shard that last failed on some host
    goes to a slot on another host when one is free. Every state change goes to `board` (UI, events).
    Returns ({shard: "done"}, {"shard N": why}).
    """
    if not todo:
        return {}, {}
    if not free:
        why = "no healthy host to run it on (every host failed its deploy check)"
        for s in todo:
            board.set_state(s, "failed", why)
        return {}, {f"shard {s}": why for s in todo}
    outcomes, failures = {}, {}
    log = get_run_logger()
    first_wave, started = min(len(todo), len(free)), time.monotonic()
    proved, lock = [0], threading.Lock()

    def drive(job: ShardJob) -> dict:
        try:
            board.set_state(job.shard, "launching", host=job.host, gpu=job.gpu)
            launched = launch(job, inventory, policy)
            board.set_state(job.shard, "running", "adopted" if launched.adopted else "launched", pid=launched.pid,
                            adopted=launched.adopted, seconds_to_proof=launched.seconds)
            with lock:
                proved[0] += 1
                if proved[0] == first_wave:
                    log.info("all %d shard(s) of the first wave verified running, %.1fs after the first launch",
                             first_wave, time.monotonic() - started)
            summary = supervise(job, launched, inventory, policy,
                                on_probe=lambda beat, age: board.beat(job.shard, beat, age))
            board.set_state(job.shard, "done", "complete", samples_done=summary.get("samples_done"))
            return summary
        except Exception as exc:
            board.set_state(job.shard, "failed", str(exc) or type(exc).__name__)
            raise
        finally:
            try:
                forget_credentials(job, inventory)
            except Exception as exc:  # the verdict stands; say the file may still be there
                log.warning("%s: credentials file %s may remain on the host: %s", job.label,
                            job.credentials_path, exc)

    def take_slot(shard: int) -> tuple[str, int]:
        avoid = board.last_failed_host(shard)
        for i, slot in enumerate(free):
            if slot[0] != avoid:
                del free[i]
                return slot
        return free.popleft()

    active: dict[cf.Future, tuple[ShardJob, tuple[str, int]]] = {}
    with cf.ThreadPoolExecutor(max_workers=len(free), thread_name_prefix="shard") as pool:
        while todo or active:
            while todo and free:
                shard = todo.popleft()
                slot = take_slot(shard)
                job = job_on(slot, shard)
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
