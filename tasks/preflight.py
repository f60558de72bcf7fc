"""The preflight: every host checked, in parallel, for what would make a run fail, before it takes a GPU.

`check_host` runs on one host, over one SSH connection, and never raises: each check ends in a `Check` (ok,
warn, fail or skip, with what it found or why it failed), so one table shows every problem of every host at
once. The checks:
  ssh       login and host key (the connection itself)
  clock     the host's clock against the orchestrator's (the midpoint of one round trip)
  bundle    the code bundle in place (pushed when missing) and the worker's packages importable
  inputs    an s3:// or orchestrator: model or dataset staged into the host's cache (tasks/stage.py), verified:
            the run then finds it in place; "skip" when both are paths on the hosts
  gpus      every GPU the inventory lists visible (`nvidia-smi`), with free memory for the model's layers
  model     config.json readable and parsed, the layers asked for in it, its weight files' size
  dataset   readable; on the first host also its samples and tokens (sampled when large)
  output    a probe object written, read back and deleted under the output, with the run's credentials
  disk      free space where the spool and the output go, against what this host's shards will write
            (judged by `judge_disk` once the dataset's tokens are known)
  benchmark optional: the real worker on the host's first GPU with random weights, its tokens/s
`plan_figures` turns the dataset's tokens and the measured rate into the run's size, time and request rate.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace

from hsextract.options import WorkerOptions
from hsextract.output.quant import fp8_bytes_per_token

from .bundle import Bundle
from .commands import bundle_dir, facts_cmd, parse_facts, preflight_cmd, quote
from .credentials import S3Access, access_on
from .deploy import DeployFailed, deploy_host
from .failures import last_line, one_line, said
from .hosts import Host, HostError, connect
from .inventory import HostSpec, Inventory
from .stage import StageFailed, on_host, stage_host

#: a host's clock off by more than this fails (S3 refuses requests signed 15 minutes off; the journals' and
#: heartbeats' times would not line up with the orchestrator's); by more than WARN_SKEW_S, a warning
MAX_SKEW_S = 30.0
WARN_SKEW_S = 2.0
#: a GPU's memory beyond the weights: the batch's activations (peak ~ this many times the batch's hidden states
#: of one layer, from the 32-layer run on the H200: 24.0 GiB peak for 22.7 GiB of weights at 8192 tokens) and
#: the CUDA context
ACTIVATION_FACTOR = 24
CUDA_CONTEXT_BYTES = 1 << 30
#: the order of a report's checks (the table's columns)
CHECKS = ("ssh", "clock", "bundle", "inputs", "gpus", "model", "dataset", "output", "disk", "benchmark")


@dataclass
class Check:
    """One check's verdict on one host: `status` ok / warn / fail / skip, and what it found or why not."""

    status: str
    detail: str


@dataclass
class HostReport:
    """Every check's verdict on one host, and the facts they were judged on."""

    host: str
    checks: dict[str, Check] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    seconds: float = 0.0

    def set(self, name: str, status: str, detail: str) -> None:
        self.checks[name] = Check(status, detail)

    @property
    def failures(self) -> list[tuple[str, str]]:
        """(check, why) of each failed check, in table order."""
        return [(name, self.checks[name].detail) for name in CHECKS
                if name in self.checks and self.checks[name].status == "fail"]


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def bytes_per_token(options: WorkerOptions, hidden: int, layers: int, on_gpu: bool) -> int:
    """Bytes of states a token adds to the output: the captured layers (and the last one's, with include_last)
    in the output dtype (fp8_e4m3 with its scales; else the run's dtype: bfloat16 on GPU, float32 on CPU)."""
    width = hidden * (layers + (1 if options.include_last else 0))
    if options.out_dtype == "fp8_e4m3":
        return fp8_bytes_per_token(hidden * layers, layers) + (hidden * 2 if options.include_last else 0)
    dtype = options.dtype if options.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    return width * (4 if dtype == "float32" else 2)


def gpu_need(found: dict, options: WorkerOptions) -> int:
    """GPU memory a worker needs: the weights of the layers it loads (up to the last captured one, or all with
    include_last), the activations of a batch of `token_budget` tokens, the CUDA context."""
    layers, kept = found["num_layers"], (found["num_layers"] if options.include_last else max(found["layers"]) + 1)
    weights = found["model_bytes"] * kept / max(1, layers)
    activations = ACTIVATION_FACTOR * options.token_budget * found["hidden_size"] * 2
    return int(weights + activations + CUDA_CONTEXT_BYTES)


def check_host(spec: HostSpec, inventory: Inventory, bundle: Bundle, version: str, options: WorkerOptions,
               access: S3Access, sample_tokens: int = 0, benchmark_samples: int = 0,
               timeout: float = 120.0, sources: dict | None = None) -> HostReport:
    """Every check on host `spec` (see the module's docstring), `sources` staged (tasks/stage.py); never raises."""
    report = HostReport(spec.name)
    started = time.monotonic()
    try:
        with connect(spec, inventory) as host:
            _checks(host, report, bundle, version, options, access, sample_tokens, benchmark_samples, timeout,
                    sources or {})
    except HostError as exc:  # the connection, or a command that lost it: what was not judged says so
        first = next((name for name in CHECKS if name not in report.checks), None)
        if first is not None:
            report.set(first, "fail", one_line(exc.reason if first == "ssh" else str(exc)))
    for name in CHECKS:
        if name not in report.checks and name != "disk":
            report.set(name, "skip", "not checked: an earlier check failed")
    report.seconds = round(time.monotonic() - started, 2)
    return report


def _checks(host: Host, report: HostReport, bundle: Bundle, version: str, options: WorkerOptions, access: S3Access,
            sample_tokens: int, benchmark_samples: int, timeout: float, sources: dict) -> None:
    spec = host.spec
    local_out = None if options.upload else str(options.out_dir)
    sent = time.time()
    result = host.run(facts_cmd(spec.workdir, local_out), timeout)  # the login itself: HostError if it fails
    back = time.time()
    report.set("ssh", "ok", "this machine (no SSH)" if spec.is_local else
               f"{spec.user + '@' if spec.user else ''}{spec.hostname}:{spec.port}, host key known")
    facts = report.facts = parse_facts(result.stdout)
    if "now" in facts:
        skew = facts["now"] - (sent + back) / 2
        facts["skew_s"] = round(skew, 3)
        margin = (back - sent) / 2
        off = f"{skew:+.1f}s against the orchestrator's (+-{margin:.1f}s)"
        report.set("clock", "fail" if abs(skew) - margin > MAX_SKEW_S else
                   "warn" if abs(skew) - margin > WARN_SKEW_S else "ok",
                   off + (f": over {MAX_SKEW_S:g}s, fix its time sync (NTP): S3 refuses requests signed 15 min off, "
                          f"and its journal and heartbeat times would not line up" if abs(skew) - margin > MAX_SKEW_S
                          else ""))
    else:
        report.set("clock", "fail", f"`date` printed no time: {one_line(result.stdout + result.stderr)}")
    try:
        deployed = deploy_host(host, bundle, version, timeout, synthetic=options.synthetic is not None)
        report.set("bundle", "ok", f"{bundle.sha256[:12]} {'in place' if deployed.skipped else 'pushed'}; "
                                   f"{deployed.environment}")
        facts["environment"] = deployed.environment
    except DeployFailed as exc:
        report.set("bundle", "fail", str(exc).removeprefix(f"host {spec.name}: "))
        return
    if sources:
        try:
            staged = stage_host(host, sources, bundle.sha256, access)
        except StageFailed as exc:
            report.set("inputs", "fail", str(exc).removeprefix(f"host {spec.name}: "))
            return
        options = on_host(options, staged)
        report.set("inputs", "ok", f"{', '.join(sources)} staged and verified: {gib(staged.sent_bytes)} sent, "
                                   f"{gib(staged.resumed_bytes)} resumed, {staged.kept_files} file(s) already there")
    else:
        report.set("inputs", "skip", "model and dataset are paths on the hosts: nothing to stage")
    found = _worker_checks(host, report, bundle, options, access, sample_tokens, timeout)
    _gpu_check(report, options, found, spec.gpus)
    if benchmark_samples and found and report.checks["dataset"].status == "ok":
        _benchmark(host, report, bundle, options, access, benchmark_samples)


def _worker_checks(host: Host, report: HostReport, bundle: Bundle, options: WorkerOptions, access: S3Access,
                   sample_tokens: int, timeout: float) -> dict:
    """`hsextract check --report` on the host: model, dataset (and its tokens), the output probe object with the
    run's credentials (a 0600 file the check reads and removes). Returns the model's facts ({} if it failed)."""
    spec = host.spec
    args = replace(options, shard=0, num_shards=1).argv() + ["--report", "--probe-output"]
    if sample_tokens:
        args += ["--sample-tokens", str(sample_tokens)]
    given: contextlib.AbstractContextManager[tuple[list[str], str]] = contextlib.nullcontext(([], ""))
    if options.upload:
        if access.has_keys:
            host.run(f"mkdir -p {quote(spec.workdir + '/preflight')} && chmod 700 "
                     f"{quote(spec.workdir + '/preflight')}", timeout)
        given = access_on(host, access, f"{spec.workdir}/preflight/credentials-{uuid.uuid4().hex[:12]}", timeout)
    with given as (extra, env):
        result = host.run(env + preflight_cmd(spec.workdir, bundle.sha256, spec.python, args + extra), timeout)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("CHECK ")), None)
    if line is None:
        for name in ("model", "dataset", "output"):
            report.set(name, "fail", f"`hsextract check` gave no verdict: {one_line(said(result))}")
        return {}
    verdicts = json.loads(line[6:])
    report.facts["check"] = verdicts
    model, data, out = verdicts.get("model", {}), verdicts.get("dataset", {}), verdicts.get("output", {})
    for name, got in (("model", model), ("dataset", data), ("output", out)):
        if "error" in got:
            report.set(name, "fail", got["error"])
    if "error" not in model:
        report.set("model", "ok", f"{model['model_type']}, {model['num_layers']} layers (hidden "
                                  f"{model['hidden_size']}), capture {model['layers']}, "
                                  f"weights {gib(model['model_bytes'])}")
    if "error" not in data:
        report.set("dataset", "ok", f"{gib(data['data_bytes'])}" + (
            f", {data['samples']:,} samples, ~{data['tokens']:,} tokens ({'all' if data['exact'] else data['sampled']}"
            f" counted: {data['counted']})" if "samples" in data else ""))
    if "error" not in out:
        report.set("output", "ok", f"probe object written, read back and deleted: {out.get('probe_object', '')}")
    return model if "error" not in model else {}


def _gpu_check(report: HostReport, options: WorkerOptions, found: dict, spec_gpus: list[int]) -> None:
    facts = report.facts
    if options.device == "cpu":
        report.set("gpus", "skip", "device cpu: no GPU used")
        return
    gpus = facts.get("gpus") or []
    if not gpus:
        why = facts.get("smi") or "nvidia-smi listed no GPU"
        if options.device == "auto":
            report.set("gpus", "warn", f"no CUDA device ({why}): with device auto the workers would run on the CPU")
        else:
            report.set("gpus", "fail", f"no CUDA device ({why}), and device is {options.device}")
        return
    by_index = {g["index"]: g for g in gpus}
    missing = [i for i in spec_gpus if i not in by_index]
    if missing:
        report.set("gpus", "fail", f"GPU(s) {missing} of the inventory not visible: nvidia-smi lists "
                                   f"{sorted(by_index)}")
        return
    need = gpu_need(found, options) if found else 0
    short = [g for i, g in by_index.items() if i in spec_gpus and g["free"] < need]
    listed = ", ".join(f"{g['index']}: {gib(g['free'])} free of {gib(g['total'])}" for i, g in sorted(by_index.items())
                       if i in spec_gpus)
    if short:
        report.set("gpus", "fail", f"GPU(s) {[g['index'] for g in short]} have less free memory than a worker needs "
                                   f"({gib(need)}: the weights of its layers, a batch's activations, the CUDA "
                                   f"context): {listed}")
    else:
        report.set("gpus", "ok", f"{len(spec_gpus)} x {gpus[0]['name']} ({listed}); a worker needs ~{gib(need)}")


def _benchmark(host: Host, report: HostReport, bundle: Bundle, options: WorkerOptions, access: S3Access,
               samples: int) -> None:
    """The real worker on the host's first GPU, random weights (`--random-weights`: no checkpoint read), over
    about `samples` samples of the dataset, into a scratch directory removed afterwards: its tokens/s."""
    spec = host.spec
    scratch = f"{spec.workdir}/preflight/bench-{uuid.uuid4().hex[:12]}"
    opts = replace(options, out=f"{scratch}/out", status_dir=None, confine="off", progress="log", s3_endpoint=None,
                   upload_from="disk", random_weights=None if options.synthetic is not None else 0)
    argv = opts.argv()
    words = [quote(a) for a in argv]
    words[argv.index("--num-shards") + 1] = "$k"  # shard 0 of as many as make it ~`samples` samples
    d = bundle_dir(spec.workdir, bundle.sha256)
    command = (f"mkdir -p {quote(scratch)} && cd {quote(scratch)} && n=$(wc -l < {quote(str(options.data))}) && "
               f"k=$(( n / {samples} )) && [ $k -ge 1 ] || k=1; "
               f"CUDA_VISIBLE_DEVICES={spec.gpus[0]} PYTHONPATH={quote(d + '/src')} {quote(spec.python)} -m hsextract "
               f"extract {' '.join(words)} </dev/null; rc=$?; cd / && rm -rf {quote(scratch)}; exit $rc")
    try:
        result = host.run(command, 900)
    except HostError as exc:
        report.set("benchmark", "fail", one_line(str(exc)))
        return
    line = next((ln for ln in reversed(result.stdout.splitlines()) if ln.startswith("SUMMARY ")), None)
    if not result.ok or line is None:
        report.set("benchmark", "fail", f"the worker failed (exit {result.returncode}): "
                                        f"{one_line(last_line(result.stderr) or last_line(result.stdout))}")
        return
    summary = json.loads(line[8:])
    report.facts["benchmark"] = summary
    where = f"GPU {spec.gpus[0]}" if report.facts.get("gpus") and options.device != "cpu" else "the CPU"
    report.set("benchmark", "ok", f"{summary['tokens_per_s']:,.0f} tok/s on {where} over "
                                  f"{summary['tokens']:,} tokens ({summary['samples_done']} samples; load "
                                  f"{summary.get('load_s', 0)}s, warm-up {summary.get('warm_s', 0)}s)")


def judge_disk(report: HostReport, options: WorkerOptions, shard_bytes: float, workers: int, shards: float) -> None:
    """The disk check, once the output's size is known: with an S3 output, the spools of the host's `workers`
    (each up to `spool_high_gb`, or its shard's output if less) on the workdir's disk; with a local one, the
    files of the ~`shards` shards the host will run, on the output's disk."""
    df = report.facts.get("df", {})
    if not df:
        return
    if options.upload:
        label, need = "workdir", workers * min(shard_bytes, options.spool_high_gb * 2**30)
        what = f"the spools of {workers} worker(s) (each its shard's output, at most spool_high_gb)"
    else:
        label, need = "output", shard_bytes * shards
        what = f"the files of ~{shards:.3g} shard(s)"
    free, mount = df.get(label, (None, "?"))
    if free is None:
        return
    place = f"{label} disk ({mount})"
    if free < need:
        report.set("disk", "fail", f"{gib(free)} free on the {place}, {what} need ~{gib(need)}")
    else:
        report.set("disk", "ok", f"{gib(free)} free on the {place}; {what} need ~{gib(need)}")


def plan_figures(tokens: int, samples: int, bytes_per_tok: int, gpus: int, rate: float | None,
                 options: WorkerOptions, num_shards: int) -> dict:
    """The run in numbers: samples, tokens, output bytes; at `rate` tokens/s per GPU (measured), GPU-hours, wall
    time on `gpus` GPUs, and (S3 output) the request rate: a file per batch, multipart above the part size."""
    out: dict[str, float] = {"samples": samples, "tokens": tokens, "bytes_per_token": bytes_per_tok,
                             "output_bytes": tokens * bytes_per_tok, "shards": num_shards, "gpus": gpus}
    file_tokens = options.token_budget
    file_bytes = file_tokens * bytes_per_tok
    out["files"] = math.ceil(tokens / max(1, file_tokens))
    if rate:
        total_rate = rate * min(gpus, num_shards)
        out.update(tokens_per_s_per_gpu=rate, gpu_hours=tokens / rate / 3600,
                   wall_hours=tokens / total_rate / 3600, output_bytes_per_s=total_rate * bytes_per_tok)
        if options.upload:
            part = options.upload_part_mb << 20
            per_file = 1 if file_bytes <= part else math.ceil(file_bytes / part) + 2
            out["s3_requests_per_s"] = total_rate / file_tokens * (per_file + 1)  # + the journal's mirror
    return out
