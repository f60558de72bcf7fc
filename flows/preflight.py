"""The `preflight` flow: every host of an inventory checked, in parallel, for what would make an `extract` run
with the same parameters fail, before it takes a GPU; then the run's plan in numbers.

One table artifact (`preflight-<run>`): a row per host, a column per check (tasks/preflight.py: SSH login and
host key, clock, bundle and imports, GPUs and their free memory, model, dataset, output probe object with the
run's credentials, disk, and with `benchmark=true` the real worker's tokens/s on random weights). One plan
artifact (`plan-<run>`): samples and tokens (counted on `sample_tokens` records spread over the dataset),
output bytes, and at the measured rate GPU-hours, wall time and the S3 request rate. The run ends Failed,
naming each host and reason, when any check failed; warnings do not fail it.

`extract(preflight="only")` (the deployment `extract/qwen-preflight`) runs this flow with the run's own
parameters; `preflight="first"` runs it before the extraction and stops there if it fails.

(No `from __future__ import annotations`: Prefect builds its parameter model from this signature.)
"""

import inspect
import time

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.board import run_key
from tasks.bundle import build_bundle
from tasks.credentials import load_access
from tasks.plan import ROOT, resolve_inventory, worker_options, worker_version
from tasks.preflight import CHECKS, HostReport, bytes_per_token, check_host, gib, judge_disk, plan_figures
from tasks.settings import (
    DEFAULT,
    GROUP_OF,
    Confine,
    Device,
    Dtype,
    Gigabytes,
    LayerSpec,
    NonEmpty,
    OutDtype,
    OutputUri,
    Positive,
    Rate,
    RunName,
    Settings,
    UploadFrom,
)
from tasks.stage import resolve_sources

__all__ = ["PREFLIGHT_PARAMETERS", "preflight"]

MARK = {"ok": "ok", "warn": "warn", "fail": "**FAIL**", "skip": "-"}


@task(name="preflight-host", cache_policy=NO_CACHE, task_run_name="preflight-{host_name}")
def check_one(host_name: str, inventory, bundle, version: str, options, access, sample_tokens: int,
              benchmark_samples: int, sources: dict | None = None) -> HostReport:
    """Task: every check on one host (tasks/preflight.py `check_host`); its report, never an exception."""
    report = check_host(inventory.host(host_name), inventory, bundle, version, options, access, sample_tokens,
                        benchmark_samples, sources=sources)
    log = get_run_logger()
    for name, why in report.failures:
        log.error("host %s: %s: %s", host_name, name, why)
    return report


# the ignore: Prefect's @flow is typed for a TaskRunner[PrefectFuture[Any]], an invariant generic that its own
# ThreadPoolTaskRunner (a TaskRunner[PrefectConcurrentFuture[...]]) does not match
@flow(name="preflight", task_runner=ThreadPoolTaskRunner(max_workers=64),  # type: ignore[arg-type]
      validate_parameters=True)
def preflight(
    model: NonEmpty,
    data: NonEmpty,
    output: OutputUri,
    hosts: NonEmpty,
    layers: LayerSpec = DEFAULT.layers,
    include_last: bool = DEFAULT.include_last,
    num_shards: Positive | None = DEFAULT.num_shards,
    run_name: RunName | None = DEFAULT.run_name,
    aws_credentials: str | None = DEFAULT.aws_credentials,
    max_length: Positive | None = DEFAULT.max_length,
    dtype: Dtype = DEFAULT.dtype,
    out_dtype: OutDtype = DEFAULT.out_dtype,
    upload_from: UploadFrom = DEFAULT.upload_from,
    upload_memory_gb: Gigabytes = DEFAULT.upload_memory_gb,
    token_budget: Positive = DEFAULT.token_budget,
    device: Device = DEFAULT.device,
    spool_high_gb: Gigabytes = DEFAULT.spool_high_gb,
    spool_low_gb: Gigabytes = DEFAULT.spool_low_gb,
    confine: Confine = DEFAULT.confine,
    synthetic_tokens_per_s: Rate | None = DEFAULT.synthetic_tokens_per_s,
    benchmark: bool = DEFAULT.benchmark,
    benchmark_samples: Positive = 64,
    sample_tokens: Positive = 1000,
):
    """Check every host of `hosts` for what an `extract` run with these parameters needs, in parallel; write
    the `preflight-<run>` table and the `plan-<run>` artifact; Failed, naming each host and reason, when a run
    would fail. `benchmark`: also time the real worker (random weights, ~`benchmark_samples` samples) on each
    host's first GPU. `sample_tokens`: dataset records tokenized (spread over the file) to estimate its tokens."""
    log = get_run_logger()
    settings = Settings.from_flat({name: value for name, value in locals().items() if name in PREFLIGHT_PARAMETERS})
    began = time.monotonic()
    run = settings.job.run
    inventory = resolve_inventory(hosts)
    access = load_access(aws_credentials)
    options = worker_options(settings, access)
    sources = resolve_sources(model, data, access)  # an s3:// or orchestrator: input that is not there fails here
    bundle, version = build_bundle(ROOT), worker_version()
    names = [h.name for h in inventory.hosts]
    futures = {name: check_one.submit(name, inventory, bundle, version, options, access,
                                      sample_tokens if i == 0 else 0, benchmark_samples if benchmark else 0, sources)
               for i, name in enumerate(names)}
    reports = {name: future.result() for name, future in futures.items()}
    if counted(reports[names[0]]) is None:  # the first host could not count the dataset: the next one that can
        for name in names[1:]:
            if reports[name].checks.get("dataset") and reports[name].checks["dataset"].status == "ok":
                reports[name] = check_one(name, inventory, bundle, version, options, access, sample_tokens, 0, sources)
                break
    plan = make_plan(reports, options, inventory, num_shards, benchmark)
    elapsed = time.monotonic() - began
    key = run_key(run)
    create_markdown_artifact(key=f"preflight-{key}", markdown=table(run, reports, elapsed),
                             description=f"preflight of run {run}: every host, every check")
    create_markdown_artifact(key=f"plan-{key}", markdown=plan_markdown(run, plan),
                             description=f"run {run} in numbers, from the preflight")
    bad = {name: r.failures for name, r in reports.items() if r.failures}
    log.info("preflight of run %s: %d host(s) checked in %.1fs, %d with problems", run, len(reports), elapsed, len(bad))
    result = {"run_name": run, "seconds": round(elapsed, 2), "plan": plan,
              "hosts": {name: {c: r.checks[c].status for c in CHECKS if c in r.checks} for name, r in reports.items()},
              "problems": {name: dict(failures) for name, failures in bad.items()}}
    if bad:
        lines = [f"- host {name}: {check}: {why}" for name, failures in bad.items() for check, why in failures]
        more = f"\n... and {len(lines) - 20} more (artifact preflight-{key})" if len(lines) > 20 else ""
        return Failed(message=f"preflight of run {run}: {len(bad)} of {len(reports)} host(s) would fail the run:\n"
                              + "\n".join(lines[:20]) + more, data=result)
    return Completed(message=f"preflight of run {run}: {len(reports)} host(s) ready", data=result)


#: the settings `preflight` shares with `extract` (same names, types and defaults), read from its signature:
#: extract passes these on
PREFLIGHT_PARAMETERS = tuple(name for name in inspect.signature(preflight.fn).parameters if name in GROUP_OF)


def counted(report: HostReport) -> dict | None:
    """The dataset's samples and tokens as the host counted them; None when it did not."""
    found = report.facts.get("check", {}).get("dataset", {})
    return found if "samples" in found else None


def make_plan(reports: dict[str, HostReport], options, inventory, num_shards: int | None, benchmark: bool) -> dict:
    """The plan's figures from the reports (the dataset's count, the model, the benchmark's rates), and each
    host's disk verdict against its share of the output."""
    count = next((c for r in reports.values() if (c := counted(r)) is not None), None)
    model = next((r.facts["check"]["model"] for r in reports.values()
                  if "error" not in r.facts.get("check", {}).get("model", {"error": 1})), None)
    if count is None or model is None:
        return {"error": "no host could read the model's config and count the dataset: no plan"}
    slots = len(inventory.slots)
    shards = num_shards or slots
    on_gpu = options.device != "cpu" and any(r.facts.get("gpus") for r in reports.values())
    per_token = bytes_per_token(options, model["hidden_size"], len(model["layers"]), on_gpu)
    rates = sorted(r.facts["benchmark"]["tokens_per_s"] for r in reports.values() if "benchmark" in r.facts)
    rate = rates[len(rates) // 2] if rates else None
    plan = plan_figures(count["tokens"], count["samples"], per_token, slots, rate, options, shards)
    plan.update(exact=count["exact"], counted=count["counted"], sampled=count["sampled"],
                rates={name: r.facts["benchmark"]["tokens_per_s"] for name, r in reports.items()
                       if "benchmark" in r.facts}, benchmark=benchmark)
    shard_bytes = plan["output_bytes"] / shards
    for name, r in reports.items():
        gpus = len(inventory.host(name).gpus)
        judge_disk(r, options, shard_bytes, gpus, shards * gpus / slots)
    return plan


def table(run: str, reports: dict[str, HostReport], seconds: float) -> str:
    """The `preflight-<run>` markdown: a row per host, a column per check; then every problem and warning."""
    head = "| host | " + " | ".join(CHECKS) + " | s |"
    rows = [head, "|" + "---|" * (len(CHECKS) + 2)]
    for name, r in reports.items():
        cells = [MARK[r.checks[c].status] if c in r.checks else "-" for c in CHECKS]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {r.seconds:.1f} |")
    problems = [f"- **{name}**, {c}: {r.checks[c].detail}" for name, r in reports.items() for c in CHECKS
                if c in r.checks and r.checks[c].status in ("fail", "warn")]
    failed = sum(1 for r in reports.values() if r.failures)
    out = [f"# Preflight of run `{run}`", "",
           f"{len(reports)} host(s) checked in {seconds:.1f} s: **{failed} would fail the run**." if failed else
           f"{len(reports)} host(s) checked in {seconds:.1f} s: all ready.", "", *rows, ""]
    if problems:
        out += ["## Problems and warnings", "", *problems, ""]
    first = next(iter(reports.values()))
    out += [f"## What host {first.host} reported", ""]
    out += [f"- {c}: {first.checks[c].status}: {first.checks[c].detail}" for c in CHECKS if c in first.checks]
    return "\n".join(out) + "\n"


def hours(h: float) -> str:
    """`2 d 3.5 h`, `3.5 h`, `12 min`, `40 s`."""
    if h >= 48:
        return f"{int(h // 24)} d {h % 24:.1f} h"
    return f"{h:.1f} h" if h >= 1 else f"{h * 60:.0f} min" if h >= 1 / 60 else f"{h * 3600:.0f} s"


def plan_markdown(run: str, plan: dict) -> str:
    """The `plan-<run>` markdown."""
    if "error" in plan:
        return f"# Plan of run `{run}`\n\n{plan['error']}\n"
    rows = [("samples", f"{plan['samples']:,}"),
            ("tokens", f"{plan['tokens']:,}" + ("" if plan["exact"] else
                                                f" (estimated from {plan['sampled']:,} samples)")
             + f", {plan['counted']}"),
            ("bytes per token", f"{plan['bytes_per_token']:,}"),
            ("output", f"{gib(plan['output_bytes'])} in ~{plan['files']:,} files, {plan['shards']} shard(s)")]
    if plan.get("tokens_per_s_per_gpu"):
        rows += [("rate (benchmark, median of hosts)", f"{plan['tokens_per_s_per_gpu']:,.0f} tok/s per GPU"),
                 ("GPU-hours", f"{plan['gpu_hours']:,.1f}" if plan["gpu_hours"] >= 10 else
                  f"{plan['gpu_hours']:.3g}"),
                 ("wall time", f"{hours(plan['wall_hours'])} on {min(plan['gpus'], plan['shards'])} GPU(s)"),
                 ("output rate", f"{gib(plan['output_bytes_per_s'])}/s")]
        if "s3_requests_per_s" in plan:
            rows.append(("S3 requests", f"{plan['s3_requests_per_s']:,.1f}/s (PUTs, multipart parts, journal)"))
    else:
        rows.append(("rate, GPU-hours, wall time", "not measured: run with benchmark=true"))
    body = "\n".join(f"| {k} | {v} |" for k, v in rows)
    rates = "".join(f"\n- {h}: {r:,.0f} tok/s" for h, r in plan.get("rates", {}).items())
    return f"# Plan of run `{run}`\n\n| what | value |\n|---|---|\n{body}\n" + (
        f"\nPer host (first GPU):{rates}\n" if rates else "")
