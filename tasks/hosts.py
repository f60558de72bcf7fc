"""One interface for running commands on a host, with an SSH (fabric) and a local (subprocess) twin.

Same semantics for both: `run` has a hard deadline and never reads stdin (`< /dev/null`); a non-zero
exit is a `Result`, not an exception; only a transport failure or a missed deadline raises `HostError`,
which names the host and command and says whether a retry may help. `put` writes a file atomically.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from hsextract.errors import Retry
from hsextract.store import make_dirs, write_atomic

from .commands import quote
from .inventory import HostSpec, Inventory
from .transient import retry_of

UMASK = "027"  # what the product makes on a host is never world-readable, nor writable by the group


def wrap(command: str) -> str:
    """`command` in a subshell under UMASK with stdin closed: how every command reaches a host's shell."""
    return f"( umask {UMASK}; {command}\n) < /dev/null"


def tail(text: str, limit: int = 2000) -> str:
    """The last `limit` characters of `text` (marked with ... when cut)."""
    return text if len(text) <= limit else "..." + text[-limit:]


@dataclass(frozen=True)
class Result:
    """A command that ran to its end on a host: its exit status and everything it printed."""
    host: str
    command: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """Exit status 0."""
        return self.returncode == 0

    def describe(self) -> str:
        """For an error message: host, command, exit status, and the tails of stdout and stderr."""
        said = "\n".join(f"{label}: {tail(text).strip()}" for label, text in
                         (("stdout", self.stdout), ("stderr", self.stderr)) if text.strip()) or "it printed nothing"
        return f"host {self.host}: `{tail(self.command, 600)}` exited {self.returncode}; {said}"


class HostError(Exception):
    """The host could not be reached or did not answer in time: nothing is known about the command. `retry`: NOW
    for a blip (`transient.retry_of`), else LATER."""

    def __init__(self, host: str, command: str, reason: str, retry: Retry, sent: bool = True):
        super().__init__(f"host {host}: `{tail(command, 600)}`: {reason}" if sent else
                         f"host {host}: {reason} (so `{tail(command, 120)}` was never sent)")
        self.host, self.command, self.reason, self.retry, self.sent = host, command, reason, retry, sent


class Host(ABC):
    """A machine that runs shell commands and takes files: the SSH and local twins share these semantics."""
    def __init__(self, spec: HostSpec):
        self.spec = spec
        self.name = spec.name

    @abstractmethod
    def run(self, command: str, timeout: float) -> Result:
        """Run a POSIX shell command with stdin closed; raise HostError past `timeout` seconds."""

    @abstractmethod
    def put(self, data: bytes, path: str, timeout: float, mode: int = 0o600) -> None:
        """Write `data` to `path` on the host atomically (temp name, then rename)."""

    @abstractmethod
    def append_files(self, files: list[tuple[str | Path, str, int]], timeout: float) -> int:
        """For each (local, path, offset): write the bytes of the local file `local` from `offset` on into `path`
        on the host at the same offset (a new file when `offset` is 0; its directory must exist). The bytes sent.
        How a staged input resumes where the last send stopped."""

    def close(self) -> None:  # noqa: B027 - a default on purpose: a local host holds no connection
        """Drop the connection, if any (the next call opens a new one)."""

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalHost(Host):
    """This machine, through /bin/sh: the embedded default, and the twin of SshHost in tests."""

    def run(self, command: str, timeout: float) -> Result:
        proc = subprocess.Popen(["/bin/sh", "-c", wrap(command)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise HostError(self.name, command, f"no answer within {timeout:.0f}s (killed)", Retry.NOW) from None
        return Result(self.name, command, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    def put(self, data: bytes, path: str, timeout: float, mode: int = 0o600) -> None:
        target = Path(path)
        try:
            make_dirs(target.parent, int(UMASK, 8))
            write_atomic(target, data, mode)
        except OSError as exc:
            raise HostError(self.name, f"put {path}", f"{exc.strerror or exc}", Retry.LATER) from None

    def append_files(self, files: list[tuple[str | Path, str, int]], timeout: float) -> int:
        sent = 0
        for local, path, offset in files:
            try:
                with open(local, "rb") as src, open(path, "r+b" if offset else "wb") as dst:
                    os.fchmod(dst.fileno(), 0o640)
                    src.seek(offset)
                    dst.seek(offset)
                    dst.truncate()
                    shutil.copyfileobj(src, dst, 8 << 20)
                    sent += dst.tell() - offset
            except OSError as exc:
                raise HostError(self.name, f"send {local} to {path}", f"{exc.strerror or exc}", Retry.LATER) from None
        return sent


@dataclass(frozen=True)
class SshTimeouts:
    """The deadlines of an SSH connection, on top of each command's own."""
    connect_s: float = 10.0   # TCP connect + banner + auth
    channel_s: float = 10.0   # opening a session channel
    grace_s: float = 5.0      # beyond a command's deadline before the link is declared dead
    keepalive_s: float = 5.0


#: most channels (commands) an SshHost opens at once on its connection: under sshd's default MaxSessions (10)
MAX_CHANNELS = 8


class SshHost(Host):
    """A host reached with fabric. Host keys are checked against known_hosts unless the inventory opts in."""

    def __init__(self, spec: HostSpec, inventory: Inventory, timeouts: SshTimeouts = SshTimeouts(),
                 channels: int = 1):
        super().__init__(spec)
        self.inventory = inventory
        self.timeouts = timeouts
        self._conn = None
        self._lock = threading.Lock()  # making the connection
        self._sftp_lock = threading.Lock()  # one file transfer at a time on the connection's SFTP session
        self.connections = 0  # made so far (a dropped one is made again when next needed)
        # commands at once on the one connection (sshd's MaxSessions is 10 by default)
        self._channels = threading.BoundedSemaphore(max(1, min(channels, MAX_CHANNELS)))

    def _connection(self):
        with self._lock:
            return self._connect()

    def _connect(self):
        from fabric import Connection
        from paramiko import AutoAddPolicy, RejectPolicy

        if self._conn is not None and self._conn.is_connected:
            return self._conn
        t = self.timeouts
        kwargs = {"banner_timeout": t.connect_s, "auth_timeout": t.connect_s, "channel_timeout": t.channel_s,
                  "allow_agent": False, "look_for_keys": self.spec.key_filename is None}
        if self.spec.key_filename:
            kwargs["key_filename"] = str(Path(self.spec.key_filename).expanduser())
        conn = Connection(self.spec.hostname, user=self.spec.user, port=self.spec.port,
                          connect_timeout=t.connect_s, connect_kwargs=kwargs)
        client = conn.client
        client.get_host_keys().clear()  # fabric 3 loads no known_hosts and accepts any key (AutoAddPolicy): only ours
        known = self.inventory.known_hosts_path(self.spec)
        if known.is_file():
            client.get_host_keys().load(str(known))
        accept = self.inventory.accepts_unknown_keys(self.spec)
        client.set_missing_host_key_policy(AutoAddPolicy() if accept else RejectPolicy())
        conn.open()
        conn.transport.set_keepalive(int(t.keepalive_s))
        self._conn = conn
        self.connections += 1
        return conn

    def _guarded(self, what: str, deadline: float, fn):
        """Run `fn(connection)` in a thread; past the deadline close the link (unblocks it) and raise."""
        box: dict = {}

        def target():
            try:
                conn = self._connection()
            except BaseException as exc:  # re-raised on the caller's thread
                box["error"], box["connecting"] = exc, True
                return
            try:
                box["value"] = fn(conn)
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=target, daemon=True, name=f"ssh-{self.name}")
        with self._channels:
            thread.start()
            thread.join(deadline + self.timeouts.grace_s)
            if thread.is_alive():
                self.close()
                raise HostError(self.name, what, f"no answer within {deadline:.0f}s (link down or host hung)",
                                Retry.NOW)
        if "error" in box:
            exc = box["error"]
            self.close()
            if box.get("connecting"):
                spec = self.spec
                raise HostError(self.name, what, f"cannot connect to {spec.user or ''}{'@' if spec.user else ''}"
                                f"{spec.hostname}:{spec.port}: {type(exc).__name__}: {exc}", retry_of(exc),
                                sent=False) from exc
            raise HostError(self.name, what, f"{type(exc).__name__}: {exc}", retry_of(exc)) from exc
        return box["value"]

    def run(self, command: str, timeout: float) -> Result:
        wrapped = wrap(command)

        def go(conn):
            from invoke.exceptions import CommandTimedOut

            started = time.monotonic()
            try:
                r = conn.run(wrapped, hide=True, warn=True, timeout=timeout, in_stream=False, pty=False)
            except CommandTimedOut:
                raise TimeoutError(f"command still running after {timeout:.0f}s") from None
            if r.exited == -1:  # no exit status: the channel closed under the command; what it printed is partial
                if time.monotonic() - started >= timeout:
                    # invoke's timer closes the channel, then finishes: a caller that sees the closed channel
                    # first gets -1, not CommandTimedOut. Past the deadline, it is the timeout.
                    timers_done(conn)
                    raise TimeoutError(f"command still running after {timeout:.0f}s")
                raise ConnectionResetError(f"the connection dropped before the command exited (no exit status; "
                                           f"it had printed {len(r.stdout)} bytes)")
            return Result(self.name, command, r.exited, r.stdout, r.stderr)

        return self._guarded(command, self._setup_s() + timeout, go)

    def _setup_s(self) -> float:
        """Time allowed before a command starts: a connection to make, or only a channel on a live one (so a
        link that dies under a live connection is noticed about `timeout` after, not `connect_s` later)."""
        return 1.0 if self._conn is not None and self._conn.is_connected else self.timeouts.connect_s

    def put(self, data: bytes, path: str, timeout: float, mode: int = 0o600) -> None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"  # unique per call: concurrent puts of one path

        def go(conn):
            parent = path.rsplit("/", 1)[0] or "/"
            conn.run(wrap(f"mkdir -p -- {quote(parent)}"), hide=True, in_stream=False, timeout=timeout)
            with self._sftp_lock:
                sftp = conn.sftp()
                with sftp.open(tmp, "wb") as handle:  # narrowed before a byte is written (secrets use 0600)
                    sftp.chmod(tmp, mode)
                    handle.write(data)
                sftp.posix_rename(tmp, path)

        self._guarded(f"put {path}", self.timeouts.connect_s + timeout, go)

    def append_files(self, files: list[tuple[str | Path, str, int]], timeout: float) -> int:
        """Through OpenSSH's `sftp` where this machine has it (C, not Python, moves the bytes: several times
        paramiko's rate), one batch over one connection, with the inventory's key, port and known_hosts; else
        paramiko's SFTP on this host's connection."""
        if shutil.which("sftp"):
            return self._openssh_send(files, timeout)

        def go(conn):
            sent = 0
            with self._sftp_lock:
                sftp = conn.sftp()
                for local, path, offset in files:
                    with open(local, "rb") as src, sftp.open(path, "r+b" if offset else "wb") as dst:
                        sftp.chmod(path, 0o640)
                        dst.set_pipelined(True)
                        src.seek(offset)
                        dst.seek(offset)
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                            sent += len(chunk)
            return sent

        return self._guarded(f"send {len(files)} file(s)", self.timeouts.connect_s + timeout, go)

    def _openssh_send(self, files: list[tuple[str | Path, str, int]], timeout: float) -> int:
        batch = "".join(f'{"reput" if offset else "put"} "{local}" "{path}"\n' for local, path, offset in files)
        what = f"sftp -b - <<< {tail(batch.strip(), 300)}"
        if any(c in str(p) for local, path, _ in files for p in (local, path) for c in '"\\\n\r'):
            raise HostError(self.name, what, "a path with a quote, backslash or newline cannot be sent", Retry.LATER,
                            False)
        spec, t = self.spec, self.timeouts
        size = sum(os.stat(local).st_size - offset for local, _, offset in files)
        args = ["sftp", "-b", "-", "-q", "-P", str(spec.port), "-R", "128", "-o", "BatchMode=yes",
                "-o", f"ConnectTimeout={int(t.connect_s)}", "-o", f"ServerAliveInterval={int(t.keepalive_s)}",
                "-o", "ServerAliveCountMax=3"]
        if self.inventory.accepts_unknown_keys(spec):
            args += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
        else:  # only the inventory's known_hosts, as for paramiko (_connect)
            args += ["-o", "StrictHostKeyChecking=yes", "-o", "GlobalKnownHostsFile=/dev/null",
                     "-o", f"UserKnownHostsFile={self.inventory.known_hosts_path(spec)}"]
        if spec.key_filename:
            args += ["-i", str(Path(spec.key_filename).expanduser()), "-o", "IdentitiesOnly=yes"]
        args += ["--", f"{spec.user}@{spec.hostname}" if spec.user else spec.hostname]  # never read as an option
        try:
            proc = subprocess.run(args, input=batch.encode(), capture_output=True, timeout=t.connect_s + timeout)
        except subprocess.TimeoutExpired:
            raise HostError(self.name, what, f"no end within {t.connect_s + timeout:.0f}s (killed)",
                            Retry.NOW) from None
        if proc.returncode != 0:
            said = tail(proc.stderr.decode(errors="replace").strip() or proc.stdout.decode(errors="replace").strip()
                        or "it printed nothing", 600)
            raise HostError(self.name, what, f"sftp exited {proc.returncode}: {said}",
                            Retry.NOW if proc.returncode == 255 else Retry.LATER)
        return size

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a dead link may fail; it is gone either way
                pass


def timers_done(conn, wait_s: float = 2.0) -> None:
    """Let invoke's timeout timers that fired on this connection finish (at most `wait_s` each): a timer closes its
    command's channel from its own thread (`Runner.kill`), and the run can return as soon as the channel is marked
    closed, while the close is still being sent; closing the connection under it then raises EOFError in the
    timer's thread. (The timers of commands still running on the connection, their channels open, are left.)"""
    for thread in threading.enumerate():
        runner = getattr(getattr(thread, "function", None), "__self__", None)
        if (isinstance(thread, threading.Timer) and getattr(runner, "context", None) is conn
                and getattr(getattr(runner, "channel", None), "closed", False)):
            thread.join(wait_s)


def connect(spec: HostSpec, inventory: Inventory, channels: int = 1) -> Host:
    """The host of `spec`: this machine for `hostname: local`, else over SSH (not connected until used; up to
    `channels` commands at once on its one connection)."""
    return LocalHost(spec) if spec.is_local else SshHost(spec, inventory, channels=channels)
