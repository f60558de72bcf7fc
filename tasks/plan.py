"""Plan a run of the `extract` flow before anything touches a host.

`plan_run(parameters)` validates what no type check can (spool marks, upload mode, shard indices, the
inventory, the credentials block), opens the output's store, reads which shards are already complete and
the attempt record (tasks/attempts.py), and says what this run will do: which shards are done, capped or to
run, with which worker options, deadlines and code bundle. Everything it refuses, it refuses here, naming
the parameter, before any launch.
"""

from __future__ import annotations

import hashlib
import re
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from hsextract.errors import CorruptOutput, Retry, UsageError
from hsextract.journal import OutputState
from hsextract.layers import parse_layer_spec
from hsextract.options import DEFAULT_KERNELS, WorkerOptions
from hsextract.recipe import Recipe, RecipeMismatch, describe
from hsextract.store import NoSuchBucket, Store, open_store, scan

from .attempts import AttemptRecord
from .bundle import Bundle, build_bundle
from .credentials import S3Access, load_access
from .failures import Failure
from .inventory import Inventory, InventoryError, load_inventory, parse_inventory
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
    aws_credentials: str | None
    bundle: Bundle
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
                           self.num_shards, aws_credentials=self.aws_credentials if upload else None,
                           credentials_file=upload and self.access.has_keys,
                           env=(("AWS_DEFAULT_REGION", self.access.region),) if upload and self.access.region else ())


def default_run_name(model: str, data: str, output: str) -> str:
    """The run name a run gets when it names none, readable and stable: the model's and the dataset's names
    and a hash of the three (`qwen3-6-27b-chats-3f9a1c`): calling again with the same ones continues it."""
    def slug(path: str) -> str:
        name = re.split(r"[/\\]", path.rstrip("/"))[-1]
        name = re.sub(r"(\.(jsonl|json|parquet|arrow|gz|zst|bz2|xz))+$", "", name, flags=re.I)
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]  # its artifact keys read the same
    digest = hashlib.sha256("\0".join((model, data, output)).encode()).hexdigest()[:6]
    return "-".join(filter(None, (slug(model), slug(data), digest)))


def run_name_of(p: dict) -> str:
    """The run name of the flow parameters `p`: theirs, or the default one."""
    return p.get("run_name") or default_run_name(str(p.get("model")), str(p.get("data")), str(p.get("output")))


def worker_version(root: Path = ROOT) -> str:
    """The worker version of the bundle (read from its source: the hosts must print exactly this)."""
    text = (root / "src" / "hsextract" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def resolve_inventory(hosts: str) -> Inventory:
    """A YAML path, or the name of a HostInventory block holding the same YAML."""
    if Path(hosts).expanduser().is_file():
        return load_inventory(hosts)
    try:
        from .blocks import HostInventory

        block = HostInventory.load(hosts)
    except Exception as exc:
        raise InventoryError(f"hosts={hosts!r}: neither an inventory file nor a HostInventory block ({exc})") from None
    return parse_inventory(block.yaml, f"block {hosts}")


def worker_options(p: dict, access: S3Access) -> WorkerOptions:
    """The workers' options from the flow's parameters `p` (the flow's defaults are WorkerOptions' own), and
    what `p` asks that the workers cannot do (ValueError naming the parameter)."""
    options = WorkerOptions(
        model=Path(p["model"]), data=Path(p["data"]), out=p["output"], layers=p["layers"], max_length=p["max_length"],
        include_last=p.get("include_last", False), kernels=p.get("kernels") or DEFAULT_KERNELS,
        overlong=p.get("long_samples") or WorkerOptions.overlong,
        max_skipped=p.get("max_skipped", WorkerOptions.max_skipped), retry_skipped=p.get("retry_skipped") or "",
        token_budget=p["token_budget"], device=p["device"], dtype=p["dtype"], out_dtype=p["out_dtype"],
        progress="log", confine=p["confine"], heartbeat_interval=p["heartbeat_interval_s"],
        spool_high_gb=p["spool_high_gb"], spool_low_gb=p["spool_low_gb"], upload_from=p["upload_from"],
        upload_memory_gb=p["upload_memory_gb"], synthetic=p.get("synthetic_tokens_per_s"))
    if p["spool_low_gb"] > p["spool_high_gb"]:
        raise ValueError(f"spool_low_gb={p['spool_low_gb']:g} is over spool_high_gb={p['spool_high_gb']:g}: "
                         f"extraction pauses above the high-water mark and resumes below the low one")
    if options.upload is None:
        if p["upload_from"] == "memory":
            raise ValueError(f"upload_from='memory' needs an s3:// output, not output={p['output']!r}: files go "
                             f"from memory straight to the store, so there is nothing to upload to on a local path")
        return replace(options, out=str(options.out_dir))  # the directory itself: hosts see the plain path
    return replace(options, s3_endpoint=access.endpoint_url)


def plan_run(p: dict, log) -> Plan:
    """The plan for the flow's parameters `p` (see flows/extract.py); raises before any launch on bad input."""
    run = run_name_of(p)
    if p["rerun_depth"] > p["max_reruns"]:
        raise RunIncomplete(f"run {run}: this is automated re-run {p['rerun_depth']}, over max_reruns="
                            f"{p['max_reruns']}: not run. Look at the failures of the earlier runs, then start it "
                            f"again by hand")
    inventory = resolve_inventory(p["hosts"])
    access = load_access(p["aws_credentials"])  # fails here, before any launch, on a missing or bad block
    options = worker_options(p, access)
    num_shards = p["num_shards"] = p["num_shards"] or len(inventory.slots)
    requested = sorted(set(p["shards"])) if p["shards"] is not None else list(range(num_shards))
    if bad := [s for s in requested if not 0 <= s < num_shards]:
        raise ValueError(f"shards={bad}: out of range for num_shards={num_shards}")
    store = open_store(p["output"], client=access.client)
    state = read_output(store, run, log)
    check_recipe(state, options, p, store.uri)
    already = {s for s in range(num_shards) if state.done(s, num_shards)} if p["shards"] is None else set()
    attempts = AttemptRecord(store, run, num_shards, log, lambda: reachable(store, inventory))
    if p["reset_attempts"]:
        attempts.reset(requested)
    capped = {s for s in requested if s not in already and attempts.get(s).failed_attempts >= p["max_attempts"]}
    todo = deque(s for s in requested if s not in already and s not in capped)
    sources = resolve_sources(p, access) if todo else {}  # checked here: before any host is touched
    plan = Plan(run, num_shards, requested, already, capped, todo, inventory, store, attempts, options, deadlines(p),
                access, p["aws_credentials"], build_bundle(ROOT), sources=sources)
    for s in sorted(capped):
        seen = attempts.get(s)
        plan.failures[f"shard {s}"] = Failure(
            seen.last_failed_host, f"attempt cap reached: failed {seen.failed_attempts} time(s) (max_attempts="
            f"{p['max_attempts']}), last: {seen.last_error or '?'}; not launched again: fix the cause, then run "
            f"with reset_attempts=true", retry=Retry.NEVER, shard=s, num_shards=num_shards)
    log.info("run %s: %d shard(s) requested, %d already complete, %d at the attempt cap, %d GPU slot(s) on "
             "%d host(s)", run, len(requested), len(already), len(capped), len(inventory.slots), len(inventory.hosts))
    return plan


def reachable(store: Store, inventory: Inventory) -> bool:
    """See `Plan.reachable`."""
    root = store.local_path("")
    return root is None or root.is_dir() or all(h.is_local for h in inventory.hosts)


def deadlines(p: dict) -> Deadlines:
    """The deadlines of launch and supervise from the flow's parameters."""
    return Deadlines(launch_timeout_s=p["launch_timeout_s"], poll_interval_s=p["poll_interval_s"],
                     stall_timeout_s=p["stall_timeout_s"], host_timeout_s=p["host_timeout_s"],
                     command_timeout_s=min(Deadlines.command_timeout_s, p["host_timeout_s"]),  # a probe waits no longer
                     progress_timeout_s=p["progress_timeout_s"])


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


def check_recipe(state: OutputState, options: WorkerOptions, p: dict, where: str) -> None:
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
