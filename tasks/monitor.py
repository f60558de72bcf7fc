"""Supervision that scales with hosts, not shards.

`HostPool` holds, for one flow run, one `Host` per host name: one SSH connection, shared by every shard on that
host (up to `hosts.MAX_CHANNELS` commands at once on it), reconnected when it drops. It also holds one
`HostMonitor` per host. A monitor's thread runs one round trip per `poll_interval_s` for the whole host:
`probe_many_cmd` reads every supervised shard's pid state, heartbeat, exit record and journal tail. It keeps
the reading, or the round trip's error.

A shard's supervise task judges the same evidence as before, from `ShardWatch.next`: the first reading newer
than the last one it judged. It opens no connection and runs no probe of its own. Only a verdict that needs
more costs a command: the kill of a stalled worker, and the worker log's tail for a failure's evidence.

A launch waits for its worker's proof of life on the same readings: while one waits, the host's round trips come
every `LAUNCH_POLL_S` instead. `DirectWatch` is the same interface over a shard's own probes (a host used outside
a pool).
"""

from __future__ import annotations

import threading
import time
import uuid

from hsextract.errors import Retry

from .commands import Probe, parse_probe, parse_probe_many, probe_cmd, probe_many_cmd
from .hosts import MAX_CHANNELS, Host, HostError, connect
from .inventory import Inventory

#: the longest wait between round trips to a host whose last ones failed (it backs off up to this)
MAX_BACKOFF_S = 10.0
#: the wait between readings while a launch waits for its worker's proof of life (one round trip for the host)
LAUNCH_POLL_S = 0.5


class HostMonitor:
    """One host's probe loop: every interval, one round trip reads every shard watched on the host."""

    def __init__(self, host: Host, interval_s: float, timeout_s: float):
        self.host, self.interval_s, self.timeout_s = host, interval_s, timeout_s
        self.cond = threading.Condition()
        self.shards: dict[str, tuple[str, str]] = {}  # key -> (control dir, journal)
        self.launching: set[str] = set()  # keys whose launch waits for a proof: readings every LAUNCH_POLL_S
        self.seq = 0  # readings so far
        self.probes: dict[str, Probe] = {}
        self.error: HostError | None = None
        self.round_trips = 0
        self.stopped = False
        self.thread: threading.Thread | None = None

    def watch(self, key: str, control: str, journal: str, launching: bool = False) -> None:
        with self.cond:
            self.shards[key] = (control, journal)
            if launching:
                self.launching.add(key)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name=f"monitor-{self.host.name}", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def unwatch(self, key: str) -> None:
        with self.cond:
            self.shards.pop(key, None)
            self.launching.discard(key)

    def next(self, key: str, after: int, cancel: threading.Event,
             wait_s: float | None = None) -> tuple[int, Probe | HostError] | None:
        """The first reading after reading `after` that covers `key` (its probe, or the round trip's error);
        None once `cancel` is set (the pool wakes every waiter then). After `wait_s` without one (a round trip
        hanging on a host cut off), a HostError (retry NOW) saying so."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self.cond:
            while not cancel.is_set() and not self.stopped:
                if self.seq > after and (self.error is not None or key in self.probes):
                    return self.seq, self.error if self.error is not None else self.probes[key]
                if deadline is not None and time.monotonic() >= deadline:
                    return after, HostError(self.host.name, "the probe round trip", f"no answer for {wait_s:.0f}s "
                                            f"(the round trip has not come back)", Retry.NOW)
                self.cond.wait(1.0 if deadline is None else max(0.01, min(1.0, deadline - time.monotonic())))
            return None

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def _loop(self) -> None:
        failures = 0
        while True:
            with self.cond:
                while not self.shards and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                shards = {key: (*where, key in self.launching) for key, where in self.shards.items()}
            began = time.monotonic()
            probes, error = self._round_trip(shards)
            with self.cond:
                self.seq += 1
                self.round_trips += 1
                self.probes, self.error = probes, error
                self.cond.notify_all()
            failures = failures + 1 if error is not None else 0
            # after a failure, try again soon, then back off (the link may be down for a while)
            pause = (self.interval_s if not failures else
                     min(MAX_BACKOFF_S, min(self.interval_s, 1.0) * 2 ** (failures - 1)))
            with self.cond:  # sooner while a launch waits (one that starts meanwhile shortens the wait)
                while not self.stopped:
                    left = began + (min(pause, LAUNCH_POLL_S) if self.launching else pause) - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)

    def _round_trip(self, shards: dict[str, tuple[str, str, bool]]) -> tuple[dict[str, Probe], HostError | None]:
        nonce = uuid.uuid4().hex[:16]
        command = probe_many_cmd([(key, *where) for key, where in shards.items()], nonce)
        what = f"the probe of its {len(shards)} shard(s)"  # named so, not by its long command, in failures
        try:
            result = self.host.run(command, self.timeout_s)
        except HostError as exc:
            return {}, HostError(self.host.name, what, exc.reason, exc.retry, exc.sent)
        probes = parse_probe_many(result.stdout, nonce)
        if not result.ok or not set(shards) <= set(probes):
            said = (result.stderr or result.stdout).strip()[-300:] or "nothing"
            return {}, HostError(self.host.name, what, f"no complete answer (exit {result.returncode}, it printed: "
                                 f"{said})", Retry.NOW)
        return probes, None


class ShardWatch:
    """One shard's readings from its host's monitor (what supervise judges)."""

    def __init__(self, pool: HostPool, job, launching: bool = False):
        self.job, self.host = job, pool.host(job.host)
        self.monitor = pool.monitor(job.host)
        self.timeout_s = pool.timeout_s
        self.key, self.launching = str(job.shard), launching
        self.seen: int | None = None
        if not launching:  # a launch's is watched from its first reading on: after the launch command's own
            self._start()

    def _start(self) -> None:
        self.seen = self.monitor.seq
        self.monitor.watch(self.key, self.job.control_dir, self.job.journal, self.launching)

    def next(self, cancel: threading.Event, wait_s: float | None = None) -> Probe | None:
        """The next reading of this shard (HostError when the host's round trip failed, or none came within
        `wait_s`); None on cancel. The host's round trips include this shard from the first call on."""
        if self.seen is None:
            self._start()
        assert self.seen is not None  # _start set it
        got = self.monitor.next(self.key, self.seen, cancel, wait_s)
        if got is None:
            return None
        self.seen, reading = got
        if isinstance(reading, HostError):  # every shard of the host gets its own copy of the round trip's error
            raise HostError(reading.host, reading.command, reading.reason, reading.retry, reading.sent)
        return reading

    def detail(self, state: Probe) -> Probe:
        """`state` with the worker log's tail (one probe of this shard alone, for a failure's evidence)."""
        try:
            return probe(self.host, self.job, self.timeout_s)
        except HostError:
            return state

    def close(self) -> None:
        self.monitor.unwatch(self.key)


class DirectWatch:
    """One shard's own probes over `host`, every `interval_s` (sooner after a failed one)."""

    def __init__(self, host: Host, job, interval_s: float, timeout_s: float, at_once: bool = True):
        self.host, self.job, self.interval_s, self.timeout_s = host, job, interval_s, timeout_s
        self.pause: float | None = None if at_once else interval_s  # at_once: no wait before the first probe

    def next(self, cancel: threading.Event, wait_s: float | None = None) -> Probe | None:
        """The next probe (after the interval); `wait_s` is moot: a probe's own timeout bounds it."""
        if self.pause is not None and cancel.wait(self.pause):
            return None
        self.pause = min(self.interval_s, 1.0)  # until this probe succeeds
        state = probe(self.host, self.job, self.timeout_s)
        self.pause = self.interval_s
        return state

    def detail(self, state: Probe) -> Probe:
        return state  # its probes carry the log already

    def close(self) -> None:
        pass


def probe(host: Host, job, timeout: float) -> Probe:
    """One round trip for one shard: pid state, STARTED line, heartbeat, exit status, journal tail, log tail."""
    return parse_probe(host.run(probe_cmd(job.control_dir, job.journal), timeout).stdout)


class HostPool:
    """A flow run's hosts: one shared connection and one monitor per host, made when first needed; every
    waiter woken at once when `cancel` is set. Use as a context manager (closes them)."""

    def __init__(self, inventory: Inventory, interval_s: float, timeout_s: float,
                 cancel: threading.Event | None = None):
        self.inventory, self.interval_s, self.timeout_s = inventory, interval_s, timeout_s
        self.cancel = cancel or threading.Event()
        self._hosts: dict[str, Host] = {}
        self._monitors: dict[str, HostMonitor] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._wake_on_cancel, name="pool-cancel", daemon=True).start()

    def host(self, name: str) -> Host:
        with self._lock:
            if name not in self._hosts:
                self._hosts[name] = connect(self.inventory.host(name), self.inventory, channels=MAX_CHANNELS)
            return self._hosts[name]

    def monitor(self, name: str) -> HostMonitor:
        host = self.host(name)
        with self._lock:
            if name not in self._monitors:
                self._monitors[name] = HostMonitor(host, self.interval_s, self.timeout_s)
            return self._monitors[name]

    def watch(self, job, launching: bool = False) -> ShardWatch:
        return ShardWatch(self, job, launching)

    def stats(self) -> dict:
        """Hosts watched, probe round trips made (all monitors) and SSH connections made (all hosts)."""
        with self._lock:
            return {"hosts": len(self._monitors), "round_trips": sum(m.round_trips for m in self._monitors.values()),
                    "connections": sum(getattr(h, "connections", 0) for h in self._hosts.values())}

    def _wake_on_cancel(self) -> None:
        while not self._closed.is_set():
            if self.cancel.wait(0.5):
                with self._lock:
                    monitors = list(self._monitors.values())
                for m in monitors:
                    m.wake()
                return

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            monitors, hosts = list(self._monitors.values()), list(self._hosts.values())
            self._monitors, self._hosts = {}, {}
        for m in monitors:
            m.stop()
        for host in hosts:
            host.close()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
