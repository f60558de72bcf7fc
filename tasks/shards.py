"""Launch one shard's worker with proof, and supervise it to a verdict (plain functions + Prefect tasks).

launch: write the shard's launch.json, start the worker detached (tasks/launch.sh), and return only once the
process is alive, has printed `STARTED` and written a heartbeat; anything else within the deadline is
`ShardFailed`. supervise: one probe per interval decides running / stalled / lost / failed / done.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from hsextract.errors import USAGE_EXIT, Retry
from hsextract.options import WorkerOptions
from hsextract.output.journal import JOURNAL_NAME, shard_dir_name
from hsextract.run.liveness import STOP_KINDS
from hsextract.store.s3 import KEY_ENV

from .commands import CREDENTIALS_FILE, Probe, bundle_dir, control_dir, kill_cmd, launch_cmd, parse_probe, quote
from .credentials import load_access
from .failures import Failure, last_line, one_line
from .hosts import Host, HostError, Result, connect, tail
from .inventory import HostSpec, Inventory
from .monitor import LAUNCH_POLL_S, DirectWatch, HostPool, probe


class ShardFailed(Exception):
    """A shard ended in a state that is not done: the message is where and the one line that says why;
    `evidence` names what ran and what it said; `failure` also says whether a re-run can help."""

    def __init__(self, evidence: str, failure: Failure):
        super().__init__(evidence, failure)

    def __str__(self) -> str:  # the task's state message: the one line; the evidence is `evidence`
        return f"{self.failure.where}: {self.failure.why}"

    def __repr__(self) -> str:  # what Prefect's logs show of it
        return f"ShardFailed: {self}"

    @property
    def evidence(self) -> str:
        """What ran on the host and what it printed, the worker log's tail."""
        return self.args[0]

    @property
    def failure(self) -> Failure:
        """The shard's `Failure`: where, the one line that says why, the evidence, its retry."""
        return self.args[1]


class ShardStopped(Exception):
    """The shard ended because it was asked to (`kind`: "cancelled", the run was cancelled; "stopped", this
    shard was stopped on purpose): not a failure, no attempt counted."""

    def __init__(self, kind: str, why: str):
        super().__init__(kind, why)
        self.kind, self.why = kind, why

    def __str__(self) -> str:
        return f"{self.kind}: {self.why}"

    @classmethod
    def parse(cls, message: str) -> ShardStopped:
        """Back from its `str` (a Cancelled task run's message)."""
        kind, _, why = message.partition(": ")
        return cls(kind if kind in STOP_KINDS else "cancelled", why or message)


@dataclass(frozen=True)
class ShardJob:
    """One shard on one GPU slot of one host: where it runs and the worker's options (`on` makes one)."""

    run: str
    host: str
    gpu: int
    workdir: str
    python: str
    bundle_sha256: str
    options: WorkerOptions   # this shard's: --shard, --num-shards, --status-dir (its control dir), --spool ...
    aws_credentials: str | None = None  # block name; its keys reach the host only as a 0600 file
    env: tuple[tuple[str, str], ...] = ()  # non-secret environment for the worker (region)

    @classmethod
    def on(cls, run: str, spec: HostSpec, gpu: int, bundle_sha256: str, options: WorkerOptions, shard: int,
           num_shards: int, *, python: str | None = None, aws_credentials: str | None = None,
           credentials_file: bool = False, env: tuple[tuple[str, str], ...] = ()) -> ShardJob:
        """Shard `shard` of `num_shards` on `spec`'s GPU `gpu`: `options` (the run's, any shard) with this shard's
        index and directories: its control dir under the host's workdir is the worker's status dir, with an
        s3:// output its spool is in there too, and so is the credentials file when the block has keys."""
        control = Path(control_dir(spec.workdir, run, shard_dir_name(shard, num_shards)))
        options = replace(options, shard=shard, num_shards=num_shards, status_dir=control,
                          spool=control / "spool" if options.upload else None,
                          aws_credentials_file=control / CREDENTIALS_FILE if credentials_file else None)
        return cls(run, spec.name, gpu, spec.workdir, python or spec.python, bundle_sha256, options,
                   aws_credentials, env)

    @property
    def shard(self) -> int:
        """The shard's index (its worker's --shard)."""
        return self.options.shard

    @property
    def num_shards(self) -> int:
        """The run's shard count (its worker's --num-shards)."""
        return self.options.num_shards

    @property
    def label(self) -> str:
        """`shard I/N on HOST (GPU G)`: how messages name the shard."""
        return f"shard {self.shard}/{self.num_shards} on {self.host} (GPU {self.gpu})"

    @property
    def control_dir(self) -> str:
        """The shard's directory on the host: launch.json, worker.log, pid, heartbeat.json, exit.json..."""
        return str(self.options.status_dir)

    @property
    def journal(self) -> str:
        """The journal the worker appends to, on the host (in the output, or in its spool for s3://)."""
        return str(self.options.shard_dir / JOURNAL_NAME)

    def argv(self) -> list[str]:
        """The worker's command line on the host."""
        return [self.python, "-m", "hsextract", "extract", *self.options.argv()]


@dataclass(frozen=True)
class Deadlines:
    """How long launch and supervise wait for each thing, in seconds."""

    launch_timeout_s: float = 60.0     # from start to STARTED + first heartbeat
    poll_interval_s: float = 2.0
    stall_timeout_s: float = 60.0      # heartbeat older than this: stalled
    progress_timeout_s: float = 1800.0  # extracting with no sample finished for this long: stalled
    host_timeout_s: float = 60.0       # probes failing for this long: host lost
    command_timeout_s: float = 30.0


@dataclass
class Launched:
    """A worker proved running: its pid and start time (together: this process, not a reused pid)."""

    pid: int
    start: str
    adopted: bool
    started_line: str
    first_heartbeat: dict = field(default_factory=dict)
    seconds: float = 0.0


def _failure(job: ShardJob, what: str, probe: Probe | None = None, result: Result | None = None,
             code: int | None = None, quote_log: bool = True) -> ShardFailed:
    """The shard's error: `what` happened, with the command's result and the worker log's tail as evidence.
    The one-line reason is `what` (with the worker's exit reason in it), or `what` and the last line the
    command or the log printed (`quote_log`); a worker's bad-argument exit (code 2, see hsextract.errors) is
    Retry.NEVER."""
    parts = [f"{job.label}: {what}"]
    said = ""
    if result is not None:
        parts.append(result.describe())
        said = last_line(result.stderr) or last_line(result.stdout)
    if probe is not None:
        parts.append(f"worker log ({job.control_dir}/worker.log) tail:\n{tail(probe.log).strip() or '(empty)'}")
        said = last_line(tail(probe.log, 4000)) or said
    why = what if code is not None or not said or not quote_log else f"{what}; it printed last: {said}"
    failure = Failure(job.host, one_line(why), "\n".join(parts), Retry.NEVER if code == USAGE_EXIT else Retry.LATER,
                      shard=job.shard, num_shards=job.num_shards)
    return ShardFailed("\n".join(parts), failure)


def launch_shard(host: Host, job: ShardJob, deadlines: Deadlines, watch=None,
                 cancel: threading.Event | None = None) -> Launched:
    """Start (or adopt) the shard's worker and wait for its proof of life; ShardFailed with the reason and
    the worker log's tail otherwise (ShardStopped when `cancel` is set meanwhile). The launch command's own
    probe is the first reading; later ones come from `watch` (`monitor.ShardWatch`: the host's shared round
    trips, which come faster while a launch waits), else from probes of its own every half second."""
    started = time.monotonic()
    config = json.dumps({**asdict(job), "argv": job.argv()}, indent=1, default=str).encode()
    host.put(config, f"{job.control_dir}/launch.json", deadlines.command_timeout_s)
    env, clear = _credentials(host, job, deadlines)
    wait_s = min(5.0, deadlines.launch_timeout_s)
    command = launch_cmd(job.control_dir, bundle_dir(job.workdir, job.bundle_sha256), job.gpu, job.argv(),
                         job.journal, wait_s, env=env, unset=clear)
    result = host.run(command, deadlines.command_timeout_s + wait_s)
    first, _, rest = result.stdout.partition("\n")
    words = first.split()
    if not result.ok or len(words) < 2 or words[0] not in ("LAUNCHED", "ADOPT") or not words[1].isdigit():
        raise _failure(job, _launch_refused(job, (result.stdout + result.stderr).strip()), result=result)
    # no start time: the process was gone before the launcher could read /proc; the probe says why
    pid, start, adopted = int(words[1]), (words[2:] or [""])[0], words[0] == "ADOPT"
    cancel = cancel or threading.Event()
    watch = watch or DirectWatch(host, job, LAUNCH_POLL_S, deadlines.command_timeout_s, at_once=False)
    state = parse_probe(rest) if rest.strip() else probe(host, job, deadlines.command_timeout_s)
    while True:
        if state is None:
            raise ShardStopped("cancelled", f"the flow run is being cancelled: worker pid {pid} not verified yet")
        elapsed = time.monotonic() - started
        if state.pid != pid or state.recorded_start != start:
            raise _failure(job, f"another launch replaced pid {pid} (now {state.pid})", watch.detail(state))
        if state.started_line and state.heartbeat and (state.alive or _exit_code(state) == 0):
            return Launched(pid, start, adopted, state.started_line, state.heartbeat, round(elapsed, 3))
        if not state.alive:
            code = _exit_code(state)
            if code is None:
                what = (f"worker pid {pid} exited at once, printing no STARTED line"
                        if not state.started_line else f"worker pid {pid} died without an exit status")
            else:
                assert state.exit is not None  # `code` was read from it
                what = f"worker pid {pid} exited with code {code}: {state.exit.get('reason')}"
            raise _failure(job, what + f" (after {elapsed:.1f}s)", watch.detail(state), code=code)
        if elapsed > deadlines.launch_timeout_s:
            host.run(kill_cmd(job.control_dir), deadlines.command_timeout_s)
            missing = "STARTED line" if not state.started_line else "heartbeat"
            raise _failure(job, f"no {missing} within {deadlines.launch_timeout_s:.0f}s; killed pid {pid}",
                           watch.detail(state))
        state = watch.next(cancel)


def _credentials(host: Host, job: ShardJob, deadlines: Deadlines) -> tuple[dict, tuple]:
    """The worker's environment for the run's AWS credentials block (a profile, a region), the keys sent as a
    0600 file the worker is told of, never in argv or the environment: (env, variables to unset)."""
    clear: tuple[str, ...]
    env, clear = dict(job.env), ()
    if job.aws_credentials:
        access = load_access(job.aws_credentials)
        body = access.credentials_file()
        if body is not None and job.options.aws_credentials_file:
            host.put(body, str(job.options.aws_credentials_file), deadlines.command_timeout_s, mode=0o600)
            clear = KEY_ENV
        elif access.profile:
            env["AWS_PROFILE"] = access.profile
        if access.region:
            env.setdefault("AWS_DEFAULT_REGION", access.region)
    return env, clear


def _launch_refused(job: ShardJob, said: str) -> str:
    """The reason of a launch command that did not say LAUNCHED or ADOPT, from what it printed."""
    if not said:
        return "launch printed nothing"
    if said.startswith("LOG UNWRITABLE"):
        return f"launch failed: cannot create the worker log {job.control_dir}/worker.log (not a writable file)"
    if said.startswith("LOCK BUSY"):
        return "launch failed: another launch of this shard held its launch lock for 30s"
    if said.startswith("BUSY "):
        return f"launch refused: worker pid {said[5:]}"
    if said.startswith("STOPPING "):
        return f"launch refused: worker pid {said[9:]}"
    return "launch failed"


def _exit_code(state: Probe) -> int | None:
    """The exit code the worker left in exit.json (None: it left none)."""
    return None if state.exit is None else int(state.exit.get("code", -1))


def supervise_shard(host: Host, job: ShardJob, launched: Launched, deadlines: Deadlines, log=None,
                    on_probe=None, cancel: threading.Event | None = None, watch=None) -> dict:
    """Poll until the shard is done (returns its summary) or not (raises ShardFailed; ShardStopped when its
    worker ended on a stop request, or at once when `cancel` is set: the run is being cancelled).

    The readings come from `watch` (`monitor.ShardWatch`: its host's shared round trips), else from probes of
    its own over `host` every `poll_interval_s`. `on_probe(heartbeat, heartbeat_age)`, when given, sees every
    successful reading (the UI's view)."""
    cancel = cancel or threading.Event()
    watch = watch or DirectWatch(host, job, deadlines.poll_interval_s, deadlines.command_timeout_s)
    last_ok = time.monotonic()
    last_progress, progress_at = None, time.monotonic()
    last_log = 0.0
    while True:
        try:  # no reading for host_timeout_s is a verdict too, however long the host's round trip hangs
            state = watch.next(cancel, max(1.0, deadlines.host_timeout_s - (time.monotonic() - last_ok)) + 0.5)
        except HostError as exc:
            down = time.monotonic() - last_ok
            if exc.retry is not Retry.NOW or down > deadlines.host_timeout_s:
                raise _failure(job, f"host unreachable for {down:.0f}s: {exc}") from None
            continue
        if state is None:
            raise ShardStopped("cancelled", "the flow run is being cancelled")
        last_ok = time.monotonic()
        if state.pid != launched.pid or state.recorded_start != launched.start:
            raise _failure(job, f"pid {launched.pid} was replaced by another launch (pid {state.pid})", state,
                           quote_log=False)
        if on_probe is not None:
            on_probe(state.heartbeat, state.heartbeat_age)
        if (summary := _ended(job, launched, state, watch)) is not None:
            return summary
        beat = state.heartbeat or {}
        age = state.heartbeat_age
        if age is None or age > deadlines.stall_timeout_s:
            host.run(kill_cmd(job.control_dir), deadlines.command_timeout_s)
            stopped = " (process is stopped, state T)" if state.state == "T" else ""
            raise _failure(job, f"stalled: no heartbeat for {age or 0:.1f}s{stopped}; killed pid {launched.pid}",
                           watch.detail(state), quote_log=False)
        # uploads count as progress: over its spool's high-water mark a worker waits for them, rightly
        progress = (beat.get("samples_done"), beat.get("tokens_done"), beat.get("bytes_uploaded"))
        if progress != last_progress:
            last_progress, progress_at = progress, time.monotonic()
        elif (beat.get("phase") in ("extracting", "uploading")
              and time.monotonic() - progress_at > deadlines.progress_timeout_s):
            host.run(kill_cmd(job.control_dir), deadlines.command_timeout_s)
            raise _failure(job, f"stalled: no progress for {deadlines.progress_timeout_s:.0f}s (no sample finished, "
                                f"no byte uploaded, phase {beat.get('phase')}); killed", watch.detail(state),
                           quote_log=False)
        if log is not None and time.monotonic() - last_log > 30:
            last_log = time.monotonic()
            log.info("%s: %s %s/%s samples, %.0f tok/s", job.label, beat.get("phase"), beat.get("samples_done"),
                     beat.get("samples_total"), beat.get("tokens_per_s", 0))


def _ended(job: ShardJob, launched: Launched, state: Probe, watch) -> dict | None:
    """None while the worker runs; its summary once it exited 0 with a `done` entry; else ShardStopped (it ended
    on a stop request) or ShardFailed (another exit, none at all, or no `done`) raised."""
    code = _exit_code(state)
    if code is not None and state.exit is not None and state.exit.get("stop") in STOP_KINDS:
        raise ShardStopped(state.exit["stop"], f"worker pid {launched.pid} exited with code {code}: "
                                               f"{state.exit.get('reason')}")
    if code is not None:
        assert state.exit is not None  # `code` was read from it
        if code == 0 and state.journal_last is not None and state.journal_last.get("kind") == "done":
            return state.journal_last["summary"]
        if code == 0:
            raise _failure(job, "worker exited 0 but its journal has no 'done' entry", watch.detail(state))
        raise _failure(job, f"worker exited with code {code}: {state.exit.get('reason')}", watch.detail(state),
                       code=code)
    if not state.alive:
        what = "a zombie" if state.state == "Z" else "gone"
        raise _failure(job, f"lost: worker pid {launched.pid} is {what} and left no exit status "
                            f"(killed -9, OOM-killed, or the host rebooted)", watch.detail(state), quote_log=False)
    return None


@contextlib.contextmanager
def host_of(job: ShardJob, inventory: Inventory, pool: HostPool | None):
    """The shard's host: the pool's shared one, else a connection of its own for the block."""
    if pool is not None:
        yield pool.host(job.host)
        return
    with connect(inventory.host(job.host), inventory) as host:
        yield host


def remove_credentials_file(job: ShardJob, inventory: Inventory, timeout: float = 30.0,
                            pool: HostPool | None = None) -> None:
    """Remove the shard's credentials file from its host (the worker also removes it when it exits); HostError
    when the host would not."""
    if job.options.aws_credentials_file is None:
        return
    with host_of(job, inventory, pool) as host:
        result = host.run(f"rm -f {quote(job.options.aws_credentials_file)}", timeout)
    if not result.ok:
        raise HostError(job.host, result.command, f"could not remove the credentials file: {result.describe()}",
                        Retry.LATER)


@task(name="launch", cache_policy=NO_CACHE, task_run_name="launch-shard-{job.shard}")
def launch(job: ShardJob, inventory: Inventory, deadlines: Deadlines, pool: HostPool | None = None) -> Launched:
    """Task: `launch_shard` over the pool's connection to the host, its proof read by the pool's monitor of the
    host (else a connection and probes of its own)."""
    with host_of(job, inventory, pool) as host:
        watch = pool.watch(job, launching=True) if pool is not None else None
        try:
            launched = launch_shard(host, job, deadlines, watch, pool.cancel if pool is not None else None)
        finally:
            if watch is not None:
                watch.close()
    get_run_logger().info("%s: %s pid %d, %s, first heartbeat after %.1fs", job.label,
                          "adopted" if launched.adopted else "running", launched.pid, launched.started_line,
                          launched.seconds)
    return launched


@task(name="supervise", cache_policy=NO_CACHE, task_run_name="supervise-shard-{job.shard}")
def supervise(job: ShardJob, launched: Launched, inventory: Inventory, deadlines: Deadlines, on_probe=None,
              cancel: threading.Event | None = None, pool: HostPool | None = None) -> dict:
    """Task: `supervise_shard` on the readings of the pool's monitor of the host (else on probes of its own over
    a connection of its own); returns the shard's summary. A shard stopped on purpose ends the task run
    Cancelled, its message `<kind>: <why>` (the caller gets `CancelledRun`)."""
    from prefect.states import Cancelled

    try:
        with host_of(job, inventory, pool) as host:
            watch = pool.watch(job) if pool is not None else None
            try:
                summary = supervise_shard(host, job, launched, deadlines, get_run_logger(), on_probe, cancel, watch)
            finally:
                if watch is not None:
                    watch.close()
    except ShardStopped as stopped:
        return Cancelled(message=str(stopped))  # type: ignore[return-value]  # Prefect: a returned State ends the run
    get_run_logger().info("%s: done: %s", job.label, json.dumps(summary))
    return summary
