"""Plan a run of the `extract` flow before anything touches a host.

`plan_run(settings)` validates what no type check can (spool marks, upload mode, shard indices, the
inventory, the credentials block), opens the output's store, reads which shards are already complete and
the attempt record (tasks/attempts.py), and says what this run will do: which shards are done, capped or to
run, with which worker options, deadlines and code bundle. Everything it refuses, it refuses here, naming
the parameter, before any launch.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from hsextract.errors import CorruptOutput, Retry, UsageError
from hsextract.options import WorkerOptions
from hsextract.output.journal import OutputState, scan
from hsextract.output.recipe import Recipe, RecipeMismatch, describe
from hsextract.run.layers import parse_layer_spec
from hsextract.store import NoSuchBucket, Store, open_store

from .attempts import AttemptRecord
from .bundle import Bundle, build_bundle
from .credentials import S3Access, load_access
from .failures import Failure
from .inventory import Inventory, InventoryError, load_inventory, parse_inventory
from .settings import Settings
from .shards import Deadlines, ShardJob
from .stage import Source, Staged, on_host, resolve_sources

ROOT = Path(__file__).resolve().parents[1]  # the checkout: what the code bundle pushed to the hosts is made of


class RunIncomplete(Exception):
    """Some requested shard is not done. The message is short (one line per cause: where, why, and where
    the evidence is); `details` lists every failure with its evidence (command, output, log tail)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message, details)

    def __str__(self) -> str:
        return self.args[0]

    def __repr__(self) -> str:  # what Prefect's logs show of it: the message, not a tuple of escaped strings
        return f"RunIncomplete: {self.args[0]}"

    @property
    def details(self) -> str:
        """Every failure with its evidence, one `- where: evidence` entry each."""
        return self.args[1] or self.args[0]


@dataclass
class Plan:
    """What a run will do, decided before any host is touched."""

    run: str
    num_shards: int
    requested: list[int]
    already: set[int]                # complete per the journals: not launched
    capped: set[int]                 # failed max_attempts times: not launched
    todo: deque                      # the shards to launch, in order
    inventory: Inventory
    store: Store                     # the output, as the orchestrator reaches it
    attempts: AttemptRecord
    options: WorkerOptions           # every shard's worker options but its index and directories
    deadlines: Deadlines
    access: S3Access
    bundle: Bundle
    settings: Settings               # the run's, with num_shards resolved (pinned for a re-run)
    failures: dict[str, Failure] = field(default_factory=dict)  # "shard N": why, for the capped ones
    stopped: dict[int, str] = field(default_factory=dict)  # held: stopped on purpose (tasks/cancel.py), why
    sources: dict[str, Source] = field(default_factory=dict)  # the inputs staged onto the hosts (tasks/stage.py)
    staged: dict[str, Staged] = field(default_factory=dict)   # per host: where its copies are

    @property
    def slots(self) -> list[tuple[str, int]]:
        """(host, GPU) pairs of the inventory: one shard runs on each at a time."""
        return self.inventory.slots

    def reachable(self) -> bool:
        """Whether the orchestrator sees the output (reconcile, the attempt record): any s3://; a file:// one
        that exists here, or that every host is this machine."""
        return reachable(self.store, self.inventory)

    def job(self, slot: tuple[str, int], shard: int) -> ShardJob:
        """Shard `shard` on GPU slot `slot` (host name, GPU index)."""
        upload = self.options.upload is not None
        options = on_host(self.options, self.staged.get(slot[0]))
        return ShardJob.on(self.run, self.inventory.host(slot[0]), slot[1], self.bundle.sha256, options, shard,
                           self.num_shards, aws_credentials=self.settings.job.aws_credentials if upload else None,
                           credentials_file=upload and self.access.has_keys,
                           env=(("AWS_DEFAULT_REGION", self.access.region),) if upload and self.access.region else ())


def worker_version(root: Path = ROOT) -> str:
    """The worker version of the bundle (read from its source: the hosts must print exactly this)."""
    text = (root / "src" / "hsextract" / "__init__.py").read_text()
    found = re.search(r'__version__ = "([^"]+)"', text)
    assert found is not None, "no __version__ in src/hsextract/__init__.py"
    return found.group(1)


def resolve_inventory(hosts: str) -> Inventory:
    """A YAML path, or the name of a HostInventory block holding the same YAML."""
    if Path(hosts).expanduser().is_file():
        return load_inventory(hosts)
    try:
        from .blocks import HostInventory

        block = cast(HostInventory, HostInventory.load(hosts))  # sync here: the block, not a coroutine
    except Exception as exc:
        raise InventoryError(f"hosts={hosts!r}: neither an inventory file nor a HostInventory block ({exc})") from None
    return parse_inventory(block.yaml, f"block {hosts}")


def worker_options(settings: Settings, access: S3Access) -> WorkerOptions:
    """The workers' options from a run's settings, and what they ask that the workers cannot do (ValueError
    naming the setting)."""
    job, capture, worker = settings.job, settings.capture, settings.worker
    options = WorkerOptions(
        model=Path(job.model), data=Path(job.data), out=job.output, layers=capture.layers,
        max_length=capture.max_length, include_last=capture.include_last, kernels=capture.kernels,
        overlong=capture.long_samples, dtype=capture.dtype, out_dtype=capture.out_dtype,
        token_budget=worker.token_budget, device=worker.device, progress="log", confine=worker.confine,
        heartbeat_interval=worker.heartbeat_interval_s, spool_high_gb=worker.spool_high_gb,
        spool_low_gb=worker.spool_low_gb, upload_from=worker.upload_from, upload_memory_gb=worker.upload_memory_gb,
        synthetic=worker.synthetic_tokens_per_s, max_skipped=worker.max_skipped, retry_skipped=worker.retry_skipped)
    if worker.spool_low_gb > worker.spool_high_gb:
        raise ValueError(f"spool_low_gb={worker.spool_low_gb:g} is over spool_high_gb={worker.spool_high_gb:g}: "
                         f"extraction pauses above the high-water mark and resumes below the low one")
    if options.upload is None:
        if worker.upload_from == "memory":
            raise ValueError(f"upload_from='memory' needs an s3:// output, not output={job.output!r}: files go "
                             f"from memory straight to the store, so there is nothing to upload to on a local path")
        return replace(options, out=str(options.out_dir))  # the directory itself: hosts see the plain path
    return replace(options, s3_endpoint=access.endpoint_url)


def plan_run(settings: Settings, log) -> Plan:
    """The plan for a run's settings (see flows/extract.py); raises before any launch on bad input."""
    job, retries = settings.job, settings.retries
    run = job.run
    if retries.rerun_depth > retries.max_reruns:
        raise RunIncomplete(f"run {run}: this is automated re-run {retries.rerun_depth}, over max_reruns="
                            f"{retries.max_reruns}: not run. Look at the failures of the earlier runs, then start it "
                            f"again by hand")
    inventory = resolve_inventory(job.hosts)
    access = load_access(job.aws_credentials)  # fails here, before any launch, on a missing or bad block
    options = worker_options(settings, access)
    num_shards = job.num_shards or len(inventory.slots)
    requested = sorted(set(job.shards)) if job.shards is not None else list(range(num_shards))
    if bad := [s for s in requested if not 0 <= s < num_shards]:
        raise ValueError(f"shards={bad}: out of range for num_shards={num_shards}")
    store = open_store(job.output, client=access.client)
    state = read_output(store, run, log)
    check_recipe(state, options, store.uri)
    already = {s for s in range(num_shards) if state.done(s, num_shards)} if job.shards is None else set()
    attempts = AttemptRecord(store, run, num_shards, log, lambda: reachable(store, inventory))
    if retries.reset_attempts:
        attempts.reset(requested)
    capped = {s for s in requested if s not in already and attempts.get(s).failed_attempts >= retries.max_attempts}
    todo = deque(s for s in requested if s not in already and s not in capped)
    sources = resolve_sources(job.model, job.data, access) if todo else {}  # checked here: before any host is touched
    plan = Plan(run, num_shards, requested, already, capped, todo, inventory, store, attempts, options,
                settings.deadlines.launcher(), access, build_bundle(ROOT), settings.replace(num_shards=num_shards),
                sources=sources)
    for s in sorted(capped):
        seen = attempts.get(s)
        plan.failures[f"shard {s}"] = Failure(
            seen.last_failed_host, f"attempt cap reached: failed {seen.failed_attempts} time(s) (max_attempts="
            f"{retries.max_attempts}), last: {seen.last_error or '?'}; not launched again: fix the cause, then run "
            f"with reset_attempts=true", retry=Retry.NEVER, shard=s, num_shards=num_shards)
    log.info("run %s: %d shard(s) requested, %d already complete, %d at the attempt cap, %d GPU slot(s) on "
             "%d host(s)", run, len(requested), len(already), len(capped), len(inventory.slots), len(inventory.hosts))
    return plan


def reachable(store: Store, inventory: Inventory) -> bool:
    """See `Plan.reachable`."""
    root = store.local_path("")
    return root is None or root.is_dir() or all(h.is_local for h in inventory.hosts)


def read_output(store: Store, run: str, log) -> OutputState:
    """The output's journals as far as the orchestrator can read them (shards whose journal ends with `done`
    are skipped without touching a host; the recipe they record is checked). A missing bucket stops the run
    here, before any launch; an output the orchestrator cannot read is left to the workers, which resume by
    id and check the recipe themselves."""
    try:
        return scan(store)
    except NoSuchBucket as exc:
        raise ValueError(f"output={store.uri!r}: {exc}") from None
    except CorruptOutput:
        raise  # a journal that does not parse: named, with its repair, before any launch
    except Exception as exc:
        if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):  # botocore's: no keys here
            raise ValueError(f"output={store.uri!r}: the orchestrator has no AWS credentials for it ({exc}): name "
                             f"a prefect-aws AwsCredentials block in aws_credentials (it may carry an endpoint_url), "
                             f"or give this process a credential chain (AWS_ACCESS_KEY_ID..., ~/.aws)") from None
        log.warning("run %s: cannot read the journals in %s from here (%s): every shard is launched, and "
                    "each skips what its journal already holds", run, store.uri, exc)
        return OutputState()


def check_recipe(state: OutputState, options: WorkerOptions, where: str) -> None:
    """RecipeMismatch when the output records more than one recipe, or one that the run's parameters
    contradict in what the orchestrator can tell without the model (the layers, resolved against the recorded
    model's depth; the last state; the dtypes; the length policy). The model's and tokenizer's content are
    compared by each worker, which reads them on its host."""
    prints = state.fingerprints()
    if len(prints) > 1:
        raise RecipeMismatch(f"output={where!r} holds {len(prints)} recipes ("
                             + "; ".join(f"{fp} in {', '.join(dirs[:3])}" for fp, dirs in prints.items())
                             + "): its samples are not one dataset; `hsextract fsck` says which files are which")
    if not prints:
        return  # nothing recorded yet (a new output, or one from before recipes were recorded)
    entry = next(iter(state.recipes.values()))
    recorded = Recipe.from_json(entry.get("recipe") or {}, f"{where} recipe")
    try:
        layers = tuple(parse_layer_spec(options.layers, recorded.num_model_layers))
    except UsageError as exc:
        raise RecipeMismatch(f"layers={options.layers!r}: {exc} (the output's model has "
                             f"{recorded.num_model_layers} layers)") from None
    if options.synthetic is not None:
        dtype = "bfloat16"  # what the synthetic worker writes, on any device
    elif options.dtype != "auto":
        dtype = options.dtype
    elif options.device == "cpu" or options.device.startswith("cuda"):
        dtype = "float32" if options.device == "cpu" else "bfloat16"  # as the worker resolves "auto"
    else:
        dtype = recorded.dtype  # device "auto": resolved on each host, where the worker compares it
    out_dtype = dtype if options.out_dtype == "auto" else options.out_dtype
    asked = {"layer_ids": layers, "include_last": bool(options.include_last), "dtype": dtype, "out_dtype": out_dtype,
             "max_length": options.max_length, "long_samples": options.overlong, "kernels": options.kernels}
    differences = [(name, value, getattr(recorded, name)) for name, value in asked.items()
                   if value != getattr(recorded, name)]
    if differences:
        raise RecipeMismatch(f"output={where!r}: the parameters differ from its recipe ({recorded.fingerprint}): "
                             f"{describe(differences)}. A deliberate change of recipe takes a new output")
