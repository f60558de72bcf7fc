"""A run's settings, declared once: typed groups (pydantic) that the flows, the plan, the re-run request, the
cancel hook and the workers' options all read as attributes (`settings.deadlines.stall_timeout_s`).

On the wire a setting is one flat name, as it always was: the flows' parameters, `prefect deployment run
extract/qwen --param stall_timeout_s=120`, a deployment's stored parameters and the automations' templates
(`flow_run.parameters.stall_timeout_s`) all use it. The flows' signatures are that flat layer: each name typed
with an alias from here and defaulting to `DEFAULT.<name>`, which these groups declare (the worker's own
settings default to `hsextract.options.WorkerOptions`, the launcher's deadlines to `tasks.shards.Deadlines`).
`Settings.from_flat` routes each flat name to its group; `Settings.flat` gives them back.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hsextract.options import ConfineMode, Dtype, Kernels, OutDtype, Overlong, UploadFrom
from hsextract.options import WorkerOptions as W

from .commands import RUN_NAME_PATTERN
from .shards import Deadlines as D

__all__ = ["DEFAULT", "DEFAULT_LAYERS", "GROUPS", "Settings", "default_run_name", "run_name_of"]

#: the layers a run captures unless told: DFlash's five, spread over the model
DEFAULT_LAYERS = "dflash:5"

# The types of the flat parameters (Prefect validates them before a run starts and renders them as form fields).
NonEmpty = Annotated[str, Field(min_length=1)]
OutputUri = Annotated[str, Field(pattern=r"^(file:///|/|s3://[^/\s]+)",
                                 description="file:///absolute/path or s3://bucket/prefix")]
LayerSpec = Annotated[str, Field(pattern=r"^\s*(dflash:[1-9]\d*|eagle3|\d+(\s*,\s*\d+)*)(\+last)?\s*$",
                                  description="dflash:N, eagle3, or layer ids like 1,16,31; +last adds the last "
                                              "decoder layer (eagle3+last: for speculators)")]
RunName = Annotated[str, Field(pattern=RUN_NAME_PATTERN, description="letters, digits, . _ - (a directory name "
                                                                     "on every host: no path, spaces or shell "
                                                                     "characters)")]
Positive = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(gt=0)]
Grace = Annotated[float, Field(ge=0)]
Gigabytes = Annotated[float, Field(gt=0)]
Share = Annotated[float, Field(ge=0, le=1)]
Device = Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")]
Reasons = Annotated[str, Field(pattern=r"^[a-z_,]*$")]
Rate = Annotated[float, Field(gt=0)]
Confine = ConfineMode
LongSamples = Overlong
Preflight = Literal["off", "first", "only"]


class Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobSettings(Group):
    """What to run over what, where, as which run."""

    model: NonEmpty
    data: NonEmpty
    output: OutputUri
    hosts: NonEmpty
    num_shards: Positive | None = None  # default: the inventory's GPU slots
    shards: list[Count] | None = None  # default: every shard not already complete
    run_name: RunName | None = None  # default: made from model, data and output (`default_run_name`)
    aws_credentials: str | None = None

    @property
    def run(self) -> str:
        """The run's name: `run_name`, or the default one."""
        return self.run_name or default_run_name(self.model, self.data, self.output)


class CaptureSettings(Group):
    """What decides the states: the output's recipe."""

    layers: LayerSpec = DEFAULT_LAYERS
    include_last: bool = W.include_last
    max_length: Positive | None = W.max_length
    dtype: Dtype = W.dtype
    out_dtype: OutDtype = W.out_dtype
    kernels: Kernels = W.kernels
    long_samples: LongSamples = W.overlong


class WorkerSettings(Group):
    """How each worker runs: batches, device, uploads and their spool, confinement, what it may skip."""

    token_budget: Positive = W.token_budget
    device: Device = W.device
    heartbeat_interval_s: Seconds = W.heartbeat_interval
    upload_from: UploadFrom = W.upload_from
    upload_memory_gb: Gigabytes = W.upload_memory_gb
    spool_high_gb: Gigabytes = W.spool_high_gb
    spool_low_gb: Gigabytes = W.spool_low_gb
    confine: Confine = W.confine
    synthetic_tokens_per_s: Rate | None = None  # no model: random states at this rate (simulating a fleet)
    max_skipped: Share = W.max_skipped
    retry_skipped: Reasons = W.retry_skipped


class DeadlineSettings(Group):
    """How long the orchestrator waits for each thing, and how often it looks."""

    launch_timeout_s: Seconds = D.launch_timeout_s
    stall_timeout_s: Seconds = D.stall_timeout_s
    poll_interval_s: Seconds = D.poll_interval_s
    host_timeout_s: Seconds = D.host_timeout_s
    progress_timeout_s: Seconds = D.progress_timeout_s
    status_interval_s: Seconds = 15.0  # the status artifact's refresh
    cancel_grace_s: Grace = 60.0  # SIGTERM to SIGKILL when a run is cancelled

    def launcher(self) -> D:
        """The deadlines of launch and supervise (a probe waits no longer than a host may be silent)."""
        return D(launch_timeout_s=self.launch_timeout_s, poll_interval_s=self.poll_interval_s,
                 stall_timeout_s=self.stall_timeout_s, host_timeout_s=self.host_timeout_s,
                 command_timeout_s=min(D.command_timeout_s, self.host_timeout_s),
                 progress_timeout_s=self.progress_timeout_s)


class RetrySettings(Group):
    """How often a shard is tried, and the chain of automated re-runs."""

    max_attempts: Positive = 3
    reset_attempts: bool = False
    rerun_depth: Count = 0  # which automated re-run this is (0: a person's or a schedule's run)
    max_reruns: Count = 10


class CheckSettings(Group):
    """What is checked besides the extraction itself."""

    verify_checksums: bool = False  # reconcile reads every local file back
    preflight: Preflight = "off"
    benchmark: bool = False  # the preflight times the real worker on each host


GROUPS: dict[str, type[Group]] = {"job": JobSettings, "capture": CaptureSettings, "worker": WorkerSettings,
                                  "deadlines": DeadlineSettings, "retries": RetrySettings, "checks": CheckSettings}
#: flat name -> its group: the wire form's one alias layer (no name is in two groups)
GROUP_OF = {name: group for group, model in GROUPS.items() for name in model.model_fields}
assert len(GROUP_OF) == sum(len(m.model_fields) for m in GROUPS.values()), "a setting's name is in two groups"
#: every setting's default by its flat name (the flows' signatures read theirs here); the job's four required
#: settings have none
DEFAULT = SimpleNamespace(**{name: field.default for model in GROUPS.values()
                             for name, field in model.model_fields.items() if not field.is_required()})


def default_run_name(model: str, data: str, output: str) -> str:
    """The run name a run gets when it names none, readable and stable: the model's and the dataset's names
    and a hash of the three (`qwen3-6-27b-chats-3f9a1c`): calling again with the same ones continues it."""
    def slug(path: str) -> str:
        name = re.split(r"[/\\]", path.rstrip("/"))[-1]
        name = re.sub(r"(\.(jsonl|json|parquet|arrow|gz|zst|bz2|xz))+$", "", name, flags=re.I)
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]  # its artifact keys read the same
    digest = hashlib.sha256("\0".join((model, data, output)).encode()).hexdigest()[:6]
    return "-".join(filter(None, (slug(model), slug(data), digest)))


def run_name_of(stored: Mapping[str, Any]) -> str:
    """The run name of a flow run's stored parameters (the wire form, as the API returns them for any run,
    perhaps of an older flow): theirs, or the default one."""
    return stored.get("run_name") or default_run_name(*(str(stored.get(k)) for k in ("model", "data", "output")))


class Settings(BaseModel):
    """All of a run's settings, by group."""

    model_config = ConfigDict(frozen=True)

    job: JobSettings
    capture: CaptureSettings = CaptureSettings()
    worker: WorkerSettings = WorkerSettings()
    deadlines: DeadlineSettings = DeadlineSettings()
    retries: RetrySettings = RetrySettings()
    checks: CheckSettings = CheckSettings()

    @classmethod
    def from_flat(cls, params: Mapping[str, Any]) -> Settings:
        """The settings of flat parameters (a flow's, a deployment's); ValueError naming an unknown one or a
        value its type refuses. Names not given take their defaults."""
        if unknown := sorted(set(params) - set(GROUP_OF)):
            raise ValueError(f"unknown setting(s) {unknown}; the settings are {sorted(GROUP_OF)}")
        grouped: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
        for name, value in params.items():
            grouped[GROUP_OF[name]][name] = value
        return cls(**{group: GROUPS[group](**values) for group, values in grouped.items()})

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> Settings:
        """The settings of a flow run's stored parameters (as the API returns them, perhaps of an older version
        of the flow: names this version does not know are left out)."""
        return cls.from_flat({name: value for name, value in stored.items() if name in GROUP_OF})

    def flat(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """The flat parameters (of `names`, a flow's: default all), as a flow run or a deployment takes them."""
        out = {name: value for group in GROUPS for name, value in getattr(self, group).model_dump().items()}
        return out if names is None else {name: out[name] for name in names}

    def replace(self, **changes: Any) -> Settings:
        """These settings with some flat ones changed (validated again)."""
        return Settings.from_flat({**self.flat(), **changes})
