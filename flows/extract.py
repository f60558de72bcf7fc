"""The `extract` flow: plan -> deploy -> run shards (launch + supervise, one per GPU slot) -> reconcile -> verdict.

Ends Completed only when every requested shard is done and the output reconciles; otherwise Failed, naming
each failed shard, its host and the reason. Calling it again with the same `run_name` and `output` continues
the run: complete shards are not redone (the worker resumes by sample id) and running ones are adopted.

Each parameter is a setting of tasks/settings.py, by its flat name: typed and defaulted from there, and read
by the flow as `Settings` (grouped: `settings.deadlines.stall_timeout_s`).

(No `from __future__ import annotations` here: Prefect validates the parameters with a pydantic model built
from this signature, and where the runner loads this file under a module name of its own (`extract.serve()`)
string annotations cannot be resolved.)
"""

import inspect
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

from prefect import flow, get_run_logger
from prefect.states import State
from prefect.task_runners import ThreadPoolTaskRunner

from hsextract.errors import Retry
from tasks.board import Board, run_key
from tasks.cancel import (
    Cancel,
    cancel_signals,
    cancelled,
    flow_run_label,
    hold_if_cancelled,
    hold_stopped_shards,
    stop_on_cancellation,
)
from tasks.deploy import deploy_hosts
from tasks.failures import Failure
from tasks.monitor import HostPool
from tasks.orphans import close_orphans
from tasks.plan import ROOT, RunIncomplete, plan_run, worker_version
from tasks.reconcile import reconcile
from tasks.rerun import completed, failed, incomplete, refused, related_resources, unreconciled
from tasks.settings import (
    DEFAULT,
    Confine,
    Count,
    Device,
    Dtype,
    Gigabytes,
    Grace,
    Kernels,
    LayerSpec,
    LongSamples,
    NonEmpty,
    OutDtype,
    OutputUri,
    Positive,
    Preflight,
    Rate,
    Reasons,
    RunName,
    Seconds,
    Settings,
    Share,
    UploadFrom,
    run_name_of,
)
from tasks.slots import run_shards
from tasks.stage import dataset_here, settle_manifests

__all__ = ["PARAMETERS", "ROOT", "extract"]


def flow_run_name() -> str:
    """What a flow run of `extract` is called: its run_name, and which automated re-run it is
    (`qwen36-chat`, `qwen36-chat · re-run 2`): the runs list shows which runs are one job."""
    from prefect.runtime import flow_run

    stored = flow_run.parameters
    name, depth = run_name_of(stored), stored.get("rerun_depth") or 0
    return f"{name} · re-run {depth}" if depth else name


def tag_flow_run(run: str) -> None:
    """Tag this flow run `run:<run_name>` (the runs list filters on tags); a view: never fails the run."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    tags = sorted({*(ctx.flow_run.tags or []), f"run:{run}"})
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(ctx.flow_run.id, tags=tags)
    except Exception as exc:
        get_run_logger().warning("run %s: flow run not tagged: %s", run, exc)


# the ignore: Prefect's @flow is typed for a TaskRunner[PrefectFuture[Any]], an invariant generic that its own
# ThreadPoolTaskRunner (a TaskRunner[PrefectConcurrentFuture[...]]) does not match
@flow(name="extract", task_runner=ThreadPoolTaskRunner(max_workers=256),  # type: ignore[arg-type]
      validate_parameters=True, flow_run_name=flow_run_name, on_cancellation=[stop_on_cancellation])
def extract(
    model: NonEmpty,
    data: NonEmpty,
    output: OutputUri,
    hosts: NonEmpty,
    layers: LayerSpec = DEFAULT.layers,
    include_last: bool = DEFAULT.include_last,
    num_shards: Positive | None = DEFAULT.num_shards,
    shards: list[Count] | None = DEFAULT.shards,
    run_name: RunName | None = DEFAULT.run_name,
    aws_credentials: str | None = DEFAULT.aws_credentials,
    max_length: Positive | None = DEFAULT.max_length,
    dtype: Dtype = DEFAULT.dtype,
    out_dtype: OutDtype = DEFAULT.out_dtype,
    upload_from: UploadFrom = DEFAULT.upload_from,
    upload_memory_gb: Gigabytes = DEFAULT.upload_memory_gb,
    token_budget: Positive = DEFAULT.token_budget,
    device: Device = DEFAULT.device,
    heartbeat_interval_s: Seconds = DEFAULT.heartbeat_interval_s,
    launch_timeout_s: Seconds = DEFAULT.launch_timeout_s,
    stall_timeout_s: Seconds = DEFAULT.stall_timeout_s,
    poll_interval_s: Seconds = DEFAULT.poll_interval_s,
    host_timeout_s: Seconds = DEFAULT.host_timeout_s,
    verify_checksums: bool = DEFAULT.verify_checksums,
    max_attempts: Positive = DEFAULT.max_attempts,
    reset_attempts: bool = DEFAULT.reset_attempts,
    rerun_depth: Count = DEFAULT.rerun_depth,
    max_reruns: Count = DEFAULT.max_reruns,
    status_interval_s: Seconds = DEFAULT.status_interval_s,
    progress_timeout_s: Seconds = DEFAULT.progress_timeout_s,
    spool_high_gb: Gigabytes = DEFAULT.spool_high_gb,
    spool_low_gb: Gigabytes = DEFAULT.spool_low_gb,
    confine: Confine = DEFAULT.confine,
    cancel_grace_s: Grace = DEFAULT.cancel_grace_s,
    synthetic_tokens_per_s: Rate | None = DEFAULT.synthetic_tokens_per_s,
    preflight: Preflight = DEFAULT.preflight,
    benchmark: bool = DEFAULT.benchmark,
    kernels: Kernels = DEFAULT.kernels,
    long_samples: LongSamples = DEFAULT.long_samples,
    max_skipped: Share = DEFAULT.max_skipped,
    retry_skipped: Reasons = DEFAULT.retry_skipped,
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

    Cancelled (the UI's Cancel, `prefect flow-run cancel`, Ctrl-C or SIGTERM to a direct call), the run stops
    every worker of its run_name on every host (SIGTERM: the file in flight is finished and journaled; SIGKILL
    after `cancel_grace_s`, on the host itself) and ends Cancelled; automated re-runs of it are held until a
    person starts it again, which resumes it (tasks/cancel.py).

    `synthetic_tokens_per_s`: the workers run no model (`hsextract extract --synthetic`): random states of the
    real size at that rate through the same files, journals and uploads, for simulating a fleet.

    `preflight`: "only" runs the `preflight` flow (flows/preflight.py: every host checked, the plan in
    numbers; `benchmark`: with a timed run of the worker on each host) with these parameters and launches
    nothing (the deployment `extract/qwen-preflight`); "first" runs it, then the extraction only if it passed.

    `kernels`: "default" (the states transformers computes, to the bit) or "fused" (fused norms and gate/up
    GEMM: ~21% faster at full depth on an H100, rounding differently; the output's recipe records it).

    `long_samples`: a sample over `max_length` (default: the model's own limit) is skipped ("skip", journaled as
    too_long) or cut to it ("truncate"). `max_skipped`: a shard that skips more than this share of its samples,
    or stores none, fails naming its reasons (not retried); `retry_skipped` ("invalid_record,too_long") makes
    the workers try the samples skipped for those reasons again (after the data or the options were fixed).
    """
    settings = Settings.from_flat({name: value for name, value in locals().items() if name in PARAMETERS})
    log = get_run_logger()
    if preflight != "off":
        from flows.preflight import PREFLIGHT_PARAMETERS
        from flows.preflight import preflight as preflight_flow

        # a sync flow called with return_state=True returns its State (Prefect's overloads also allow an Awaitable)
        checked = cast(State, preflight_flow(**settings.flat(PREFLIGHT_PARAMETERS), return_state=True))
        if preflight == "only" or not checked.is_completed():  # this run ends as its preflight did
            from prefect.states import Completed, Failed

            end = Completed if checked.is_completed() else Failed
            return end(message=checked.message, data=checked.result(raise_on_failure=False))
        log.info("preflight passed: %s", checked.message)
    plan = board = cancel = None
    try:
        try:
            plan = plan_run(settings, log)
        except ValueError as exc:  # refused before anything ran (another recipe, bad inventory, no credentials)
            return refused(settings.job.run, exc, log)
        tag_flow_run(plan.run)
        if (held := hold_if_cancelled(plan, log)) is not None:
            return held
        hold_stopped_shards(plan, log)
        close_orphans(plan.run, log)
        cancel = Cancel(plan.run, plan.inventory, cancel_grace_s, log, by=flow_run_label())
        with Board(plan.run, plan.num_shards, plan.requested, plan.attempts, status_interval_s, related_resources(),
                   uploads=plan.options.upload is not None) as board:
            for shard in sorted(plan.already):
                board.set_state(shard, "complete", "already complete")
            for shard in sorted(plan.capped):
                board.set_state(shard, "capped", plan.failures[f"shard {shard}"].why)
            for shard, why in sorted(plan.stopped.items()):
                board.set_state(shard, "stopped", why)
            checks = replace(plan.options, shard=0, num_shards=plan.num_shards)  # each host checks its inputs
            healthy, failures, plan.staged = (
                deploy_hosts(plan.inventory, plan.bundle, worker_version(), checks, plan.sources, plan.access)
                if plan.todo else (set(), {}, {}))
            if plan.staged:
                plan.sources, odd = settle_manifests(plan.sources, plan.staged, plan.access, log)
                for name, why in odd.items():
                    healthy.discard(name)
                    failures[f"host {name}"] = Failure(name, why)
            for failure in failures.values():
                board.host_failed(failure.host, failure.why)
            d = plan.deadlines
            with HostPool(plan.inventory, d.poll_interval_s, d.command_timeout_s, cancel.event) as pool:
                began = time.monotonic()
                done, shard_failures = run_shards(plan, healthy, board, failures, cancel, pool)
                s = pool.stats()
                log.info("run %s: supervised with %d probe round trip(s) to %d host(s) in %.0fs, %d SSH "
                         "connection(s) made (shared by launches, probes and kills)", plan.run, s["round_trips"],
                         s["hosts"], time.monotonic() - began, s["connections"])
        return conclude(plan, board, done, {**plan.failures, **failures, **shard_failures}, log)
    except cancel_signals() as exc:
        return cancelled(plan, board, cancel, exc, log)


#: every parameter of `extract`, in order (read from its signature): an automated re-run passes all of them on
#: (deployments/qwen.py)
PARAMETERS = tuple(inspect.signature(extract.fn).parameters)


def conclude(plan, board: Board, done: dict[int, str], failures: dict, log):
    """The run's verdict once its shards ended: Failed naming every failure (and asking for a re-run where one
    can help), else the output reconciled against the dataset and Completed."""
    for shard, outcome in done.items():  # ended on a stop request: named, not retried, no attempt counted
        if outcome in ("stopped", "cancelled"):
            failures[f"shard {shard}"] = Failure("", f"{outcome} on purpose (its worker was asked to stop): not "
                                                     f"re-run until a person starts the run again",
                                                 retry=Retry.NEVER, shard=shard, num_shards=plan.num_shards)
    outcomes = {**done, **{s: "done (already complete)" for s in plan.already}, **{s: "capped" for s in plan.capped},
                **{s: "stopped" for s in plan.stopped}}
    job = plan.settings.job
    summary = {"run_name": plan.run, "output": job.output, "num_shards": plan.num_shards,
               "shards": {str(s): outcomes.get(s, "failed") for s in plan.requested}}
    if failures:
        return failed(plan, board, incomplete(plan, summary["shards"], failures, log))
    log.info("run %s: all %d requested shard(s) complete", plan.run, len(plan.requested))
    data = dataset_here(job.data, plan.sources, plan.access) if plan.reachable() else job.data
    if not (plan.reachable() and Path(data).exists()):
        log.warning("run %s: reconcile skipped: the output or the dataset (%s) is not visible from the orchestrator "
                    "(file:// output on remote hosts, or a dataset path only the hosts have)", plan.run, data)
        return completed(plan, board, summary, f"{len(plan.requested)} shard(s) done (not reconciled from here)")
    summary["reconcile"] = reconcile(plan.store, data, plan.num_shards, plan.settings.checks.verify_checksums,
                                     artifact_key=f"reconcile-{run_key(plan.run)}")
    if error := unreconciled(plan, summary["reconcile"], log):
        return failed(plan, board, error, "failed: samples missing")
    checked = summary["reconcile"]
    if checked["expected"] == 0 or len(checked["recipes"]) > 1 or checked["changed"]:  # no re-run can help
        why = ("the dataset has no samples: nothing was extracted, nothing sealed" if checked["expected"] == 0 else
               f"the output holds {len(checked['recipes'])} recipes ({', '.join(checked['recipes'])}): not one "
               f"dataset, not sealed; `hsextract fsck {job.output}` lists which files are which"
               if len(checked["recipes"]) > 1 else
               f"{checked['changed']} record(s) of {job.data} are not the records their stored samples were "
               f"made from (e.g. {', '.join(checked['changed_ids'][:3])}): the dataset changed, or another one "
               f"reuses its ids; not sealed. A changed dataset takes a new output")
        log.error("run %s: %s", plan.run, why)
        return failed(plan, board, RunIncomplete(f"run {plan.run}: {why}"), "failed: not one dataset")
    return completed(plan, board, summary, f"{summary['reconcile']['done']} sample(s) stored and reconciled",
                     {"reconcile": f"artifact `reconcile-{run_key(plan.run)}`"})
