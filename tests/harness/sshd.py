"""Real OpenSSH servers for tests: a farm of throw-away sshd "hosts" on loopback or in network namespaces.

Usage::

    with SshdFarm() as farm:
        a = farm.add_host("a")                 # sshd on 127.0.0.1:<free port>
        b = farm.add_host("b", netns=True)     # sshd in its own network namespace, 10.251.X.2:22
        subprocess.run(a.ssh_argv("echo", "ok"), check=True)
        farm.cut("b"); ...; farm.restore("b")  # b vanishes from the network and comes back
        farm.stop("a")                         # a's sshd dies

Every host accepts the farm's one user key (``farm.user_key``) for the current user, and its host key is listed in
``farm.known_hosts``. Network namespaces need root and a working ``ip netns``; without them ``add_host(netns=True)``
falls back to loopback and returns a host whose ``netns`` is None. No fixture lives here (conftest defines those).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import getpass
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

__all__ = ["FarmHost", "SshdFarm", "SshdError", "netns_supported", "clean_stale"]

SSHD = "/usr/sbin/sshd"
PASSED_ON = ("OMP_NUM_THREADS",)  # the suite's own settings every host session gets too (conftest.py)
NS_PREFIX = "hsx-"
_NS_RE = re.compile(r"^hsx-(\d+)-(\S+)$")
_LINK_RE = re.compile(r"^hsx[vst](\d+)$")  # hsxvX: veth to host X; hsxsX/hsxtX: its silent "sink" pair
_SUBNET = "10.251"
_READY_TIMEOUT = 10.0
_ns_counter = itertools.count(1)


class SshdError(RuntimeError):
    """An sshd did not come up, or a namespace/link operation failed."""


@dataclass
class FarmHost:
    """One reachable sshd: where it listens, how to log in, and how to verify it."""

    name: str
    hostname: str
    port: int
    user: str
    key_filename: Path
    known_hosts: Path
    netns: str | None
    sshd_pid: int
    host_public_key: str  # "ssh-ed25519 AAAA..." (no comment)
    gateway: str | None = None  # root-namespace address as seen from inside a netns host (10.251.X.1)

    @property
    def known_hosts_pattern(self) -> str:
        """The host part of this host's known_hosts line: ``[addr]:port``, or bare ``addr`` for port 22."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def ssh_argv(self, *remote: str, known_hosts: Path | None = None, connect_timeout: float = 5,
                 options: Mapping[str, str] | None = None) -> list[str]:
        """An OpenSSH client argv that logs in to this host with the farm key and strict host key checking.

        ``known_hosts``/``connect_timeout``/``options`` override the defaults (ssh uses the first value it sees for
        an option, so overrides must be here rather than appended).
        """
        opts = {
            "UserKnownHostsFile": str(known_hosts or self.known_hosts),
            "GlobalKnownHostsFile": "/dev/null",
            "StrictHostKeyChecking": "yes",
            "BatchMode": "yes",
            "ConnectTimeout": str(max(1, math.ceil(connect_timeout))),  # whole seconds only
            "IdentitiesOnly": "yes",
            "IdentityAgent": "none",
            "GSSAPIAuthentication": "no",
            "UpdateHostKeys": "no",
        }
        opts.update(options or {})
        argv = ["ssh", "-F", "none", "-p", str(self.port), "-i", str(self.key_filename)]
        for k, v in opts.items():
            argv += ["-o", f"{k}={v}"]
        return [*argv, f"{self.user}@{self.hostname}", *remote]


# --------------------------------------------------------------------------------------------------------------------
# small process / ip helpers


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a command, capture text output; raise SshdError with its stderr if ``check`` and it fails."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise SshdError(f"{' '.join(argv)} failed (rc={proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies count as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc), deepest last."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(pids: Sequence[int]) -> None:
    """SIGKILL each pid, ignoring ones already gone."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _wait_gone(pids: Sequence[int], timeout: float = 5.0) -> None:
    """Wait until none of ``pids`` exists (reaping our own children is the caller's job)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_pid_alive(p) and not _is_zombie(p) for p in pids):
        time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_ssh_port(host: str, port: int, timeout: float = 0.5) -> str | None:
    """None if an SSH server greets on host:port, else what went wrong."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"SSH-2.0-hsx-probe\r\n")  # so sshd does not log "kex_exchange_identification" errors
            banner = s.recv(64)  # a real sshd greets first; guards against a foreign listener
    except OSError as e:
        return f"TCP: {e}"
    return None if banner.startswith(b"SSH-") else f"no SSH banner ({banner!r})"


def _keygen(path: Path, comment: str) -> str:
    """Make an ed25519 key pair at ``path``; return the public key as ``ssh-ed25519 AAAA...``."""
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    return " ".join(path.with_name(path.name + ".pub").read_text().split()[:2])


def _ns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def _ns_list() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _delete_ns(ns: str) -> None:
    """Kill every process in namespace ``ns`` and delete it (its veth ends go with it)."""
    for _ in range(3):
        pids = _ns_pids(ns)
        if not pids:
            break
        _kill(pids)
        _wait_gone(pids, 2.0)
    _run(["ip", "netns", "del", ns], check=False)


@contextlib.contextmanager
def _netns_lock() -> Iterator[None]:
    """A host-wide lock so concurrent farms (other processes) do not pick the same 10.251.X subnet."""
    path = Path("/run/hsx-sshhosts.lock") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir(),
                                                                                     "hsx-sshhosts.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=1)
def netns_supported() -> bool:
    """True when we are root and can create a network namespace with a veth pair into it (probed once)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    ns, link = f"{NS_PREFIX}{os.getpid()}-probe", f"hsxp{os.getpid() % 10_000_000}"
    try:
        _run(["ip", "netns", "add", ns])
        try:
            _run(["ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            return True
        finally:
            _run(["ip", "link", "del", link], check=False)
            _run(["ip", "netns", "del", ns], check=False)
    except (SshdError, OSError, subprocess.SubprocessError):
        return False


def _procs_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (sshd rewrites its title but keeps the config path in it)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if text in Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(entry))
    return out


def clean_stale() -> list[str]:
    """Remove what farms of dead processes left: ``hsx-<pid>-*`` namespaces (killing what runs inside), their
    ``hsxv*/hsxs*`` links, ``hsx-sshd-<pid>-*`` temp dirs and sshds still running from them. Returns what went."""
    removed: list[str] = []
    for d in Path(tempfile.gettempdir()).glob("hsx-sshd-*-*"):
        m = re.match(r"^hsx-sshd-(\d+)-", d.name)
        if not m or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))) or not d.is_dir():
            continue
        pids = [p for p in _procs_mentioning(f"{d}/") if p != os.getpid()]
        _kill(pids)
        _wait_gone(pids, 2.0)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None:
        return removed
    with _netns_lock():
        for ns in _ns_list():
            m = _NS_RE.match(ns)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                _delete_ns(ns)
                removed.append(ns)
        # Root-side links carry their namespace's name as alias; drop any whose owner is dead.
        with contextlib.suppress(ValueError, SshdError, OSError):
            for link in json.loads(_run(["ip", "-j", "link", "show"]).stdout or "[]"):
                name, alias = link.get("ifname", ""), link.get("ifalias", "")
                m = _NS_RE.match(alias or "")
                if _LINK_RE.match(name) and m and not _pid_alive(int(m.group(1))):
                    if _run(["ip", "link", "del", name], check=False).returncode == 0:
                        removed.append(name)
    return removed


def _used_subnets() -> set[int]:
    """Third octets of 10.251.X.* addresses and hsxvX links already present in the root namespace."""
    used: set[int] = set()
    with contextlib.suppress(ValueError, SshdError):
        for link in json.loads(_run(["ip", "-j", "addr", "show"]).stdout or "[]"):
            m = _LINK_RE.match(link.get("ifname", ""))
            if m:
                used.add(int(m.group(1)))
            for a in link.get("addr_info", []):
                parts = str(a.get("local", "")).split(".")
                if len(parts) == 4 and ".".join(parts[:2]) == _SUBNET:
                    used.add(int(parts[2]))
    return used


# --------------------------------------------------------------------------------------------------------------------


@dataclass
class _HostState:
    host: FarmHost
    dir: Path
    config: Path
    log: Path
    proc: subprocess.Popen | None = None
    link: str | None = None  # root-side veth end
    subnet: int | None = None
    is_cut: bool = False
    env: dict[str, str] = field(default_factory=dict)  # set in every session sshd starts (SetEnv)
    mounts: dict[str, int] = field(default_factory=dict)  # path -> tmpfs size in bytes, seen by this host alone


class SshdFarm:
    """A temp dir of keys and configs plus one running sshd per added host; ``close()`` removes all of it.

    One ed25519 user key (``user_key``) logs in to every host as the current user; ``known_hosts`` lists every
    host's key. Use as a context manager. If the process dies without closing the farm, its sshds get SIGKILL
    from the kernel (``setpriv --pdeathsig``; tied to the thread that added the host), and the next farm to start
    removes the namespaces, links and temp dirs it left (``clean_stale``).
    """

    def __init__(self, base_dir: Path | str | None = None, *, ready_timeout: float = _READY_TIMEOUT,
                 skip_shell_rc: bool = True, log_level: str = "ERROR") -> None:
        """Create the temp dir and the shared user key; clean stale namespaces of dead processes.

        ``skip_shell_rc``: remote commands do not source the user's ~/.bashrc (sshd sets SHLVL=1), so the remote
        environment is sshd's plain default (PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin).
        ``log_level``: sshd's LogLevel (INFO logs each accepted connection: `connections()` counts them).
        """
        self.log_level = log_level
        self.ready_timeout = ready_timeout
        self.skip_shell_rc = skip_shell_rc
        self.user = getpass.getuser()
        self._hosts: dict[str, _HostState] = {}
        self._namespaces: list[str] = []
        self._links: list[str] = []
        self._closed = False
        self._seq = itertools.count()
        self._setpriv = shutil.which("setpriv")
        self.directory = Path(tempfile.mkdtemp(prefix=f"hsx-sshd-{os.getpid()}-", dir=base_dir))
        atexit.register(self.close)
        try:
            if not Path(SSHD).exists():
                raise SshdError(f"{SSHD} not found (install openssh-server)")
            clean_stale()
            self.user_key = self.directory / "id_ed25519"
            self.user_public_key = _keygen(self.user_key, "hsx-farm-user")
            self.authorized_keys = self.directory / "authorized_keys"
            self.authorized_keys.write_text(self.user_public_key + "\n")
            self.known_hosts = self.directory / "known_hosts"
            self.known_hosts.write_text("")
            run_sshd = Path("/run/sshd")  # privilege separation directory, sshd refuses to start without it
            if not run_sshd.is_dir():
                try:
                    run_sshd.mkdir(mode=0o755, parents=True, exist_ok=True)
                    os.chmod(run_sshd, 0o755)
                except PermissionError:  # not root: sshd will say so itself if it needs it
                    pass
        except BaseException:
            self.close()
            raise

    # ---- context manager ----------------------------------------------------------------------------------------

    def __enter__(self) -> "SshdFarm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- queries --------------------------------------------------------------------------------------------------

    @property
    def netns_available(self) -> bool:
        """Whether ``add_host(netns=True)`` will really put the host in its own network namespace."""
        return netns_supported()

    @property
    def hosts(self) -> dict[str, FarmHost]:
        """Name -> host, in the order they were added (a copy)."""
        return {n: s.host for n, s in self._hosts.items()}

    def host(self, name: str) -> FarmHost:
        """The host called ``name``."""
        return self._state(name).host

    def namespaces(self) -> list[str]:
        """Network namespaces this farm created (and has not yet deleted)."""
        return list(self._namespaces)

    def sshd_log(self, name: str) -> str:
        """What that host's sshd wrote to stderr so far."""
        with contextlib.suppress(OSError):
            return self._state(name).log.read_text(errors="replace")
        return ""

    def connections(self, name: str) -> int:
        """SSH connections that host's sshd accepted so far (needs ``log_level="INFO"``)."""
        return self.sshd_log(name).count("Accepted publickey")

    def _state(self, name: str) -> _HostState:
        try:
            return self._hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r} in this farm (have {sorted(self._hosts)})") from None

    # ---- hosts ----------------------------------------------------------------------------------------------------

    def add_host(self, name: str, netns: bool = False, env: dict[str, str] | None = None,
                 mounts: dict[str, int] | None = None) -> FarmHost:
        """Start an sshd for a new host and wait until ``ssh host true`` works.

        ``netns=False``: 127.0.0.1 on a free port. ``netns=True``: its own network namespace joined to ours by a veth
        pair, listening on 10.251.X.2:22 (falls back to loopback with ``host.netns is None`` when unavailable).
        ``env``: variables sshd sets in every session (e.g. libfaketime's, for a host whose clock is off).
        ``mounts``: {path: bytes}: an empty tmpfs of that size over each path, in a mount namespace of this host's
        own (needs root): what differs between separate machines (a directory missing there, a full disk).
        """
        if self._closed:
            raise SshdError("farm is closed")
        if name in self._hosts:
            raise ValueError(f"host {name!r} already exists")
        hdir = self.directory / "hosts" / f"{next(self._seq):03d}-{_safe(name)}"
        hdir.mkdir(parents=True)
        host_key = hdir / "ssh_host_ed25519_key"
        pub = _keygen(host_key, f"hsx-host-{name}")
        host = FarmHost(name=name, hostname="127.0.0.1", port=0, user=self.user, key_filename=self.user_key,
                       known_hosts=self.known_hosts, netns=None, sshd_pid=0, host_public_key=pub)
        st = _HostState(host=host, dir=hdir, config=hdir / "sshd_config", log=hdir / "sshd.log", env=dict(env or {}),
                        mounts=dict(mounts or {}))
        self._hosts[name] = st
        try:
            if netns and self.netns_available:
                self._setup_netns(st)
                host.port = 22
                self._write_known_hosts()
                self._start(st)
            else:
                errors = []
                for _ in range(5):
                    host.port = _free_port()
                    self._write_known_hosts()
                    try:
                        self._start(st)
                        break
                    except _PortInUse as e:
                        errors.append(str(e))
                else:
                    raise SshdError(f"sshd for {name!r} could not bind a port after 5 tries:\n" + "\n".join(errors))
        except BaseException:
            self._discard(st)
            raise
        return host

    def _setup_netns(self, st: _HostState) -> None:
        """Create the namespace, the veth pair and addresses for a netns host."""
        ns = f"{NS_PREFIX}{os.getpid()}-{next(_ns_counter)}"
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        st.host.netns = ns
        with _netns_lock():
            used = _used_subnets()
            free = [x for x in range(1, 255) if x not in used]
            if not free:
                raise SshdError(f"no free {_SUBNET}.X.0/30 subnet left")
            x = free[0]
            link = f"hsxv{x}"
            _run(["ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns])
            self._links.append(link)
            st.link, st.subnet = link, x
            _run(["ip", "link", "set", link, "alias", ns])
            _run(["ip", "addr", "add", f"{_SUBNET}.{x}.1/30", "dev", link])
            _run(["ip", "link", "set", link, "up"])
            # While cut (hsxvX down) the connected route vanishes and packets would follow the default route out of
            # the machine (in some sandboxes a proxy there even accepts the TCP connection). A fallback route into a
            # veth whose peer stays down drops them silently instead, like a real partition: connects time out.
            sink = f"hsxs{x}"
            _run(["ip", "link", "add", sink, "type", "veth", "peer", "name", f"hsxt{x}"])
            self._links.append(sink)
            _run(["ip", "link", "set", sink, "alias", ns])
            _run(["ip", "link", "set", f"hsxt{x}", "alias", ns])
            _run(["ip", "link", "set", sink, "up"])
            _run(["ip", "route", "add", f"{_SUBNET}.{x}.0/30", "dev", sink, "metric", "1000"])
        _run(["ip", "-n", ns, "addr", "add", f"{_SUBNET}.{x}.2/30", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", f"{_SUBNET}.{x}.1"], check=False)
        st.host.hostname = f"{_SUBNET}.{x}.2"
        st.host.gateway = f"{_SUBNET}.{x}.1"

    def _write_config(self, st: _HostState) -> None:
        h = st.host
        st.config.write_text("\n".join([
            f"ListenAddress {h.hostname}",
            f"Port {h.port}",
            f"HostKey {st.dir / 'ssh_host_ed25519_key'}",
            f"PidFile {st.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PermitRootLogin prohibit-password",
            "Subsystem sftp internal-sftp",
            "MaxStartups 200:30:300",
            "MaxSessions 100",
            f"LogLevel {self.log_level}",
            "UseDNS no",
            "KexAlgorithms -sntrup761x25519-sha512*",  # post-quantum kex costs ~0.13 s of CPU per connection here
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            # bash sources ~/.bashrc for non-interactive commands run by sshd unless SHLVL says it is nested. On
            # this kind of machine root's .bashrc runs `pyenv init` (a locked `pyenv rehash`); concurrent or killed
            # sessions then stall for up to 60 s on a stale lock and rewrite the shared shims under everyone.
            *(["SetEnv " + " ".join(session_env)] if (session_env := [
                *(["SHLVL=1"] if self.skip_shell_rc else []),
                *(f"{k}={os.environ[k]}" for k in PASSED_ON if k in os.environ and k not in st.env),
                *(f"{k}={v}" for k, v in st.env.items())]) else []),
            "",
        ]))

    def _start(self, st: _HostState) -> None:
        """Write the config, spawn sshd (in the namespace if any) and wait until it is usable."""
        h = st.host
        self._write_config(st)
        argv = [SSHD, "-D", "-e", "-f", str(st.config)]
        if st.mounts:  # sshd (and so every session) in a mount namespace of its own, with the tmpfs mounts
            mount = "; ".join(f"mkdir -p {shlex.quote(p)} && mount -t tmpfs -o size={size} hsx-{st.host.name} "
                              f"{shlex.quote(p)}" for p, size in st.mounts.items())
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    f"set -e; {mount}; exec {shlex.join(argv)}"]
        if self._setpriv:
            argv = [self._setpriv, "--pdeathsig", "KILL", *argv]
        if h.netns:
            argv = ["ip", "netns", "exec", h.netns, *argv]
        with open(st.log, "ab") as log:
            st.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        h.sshd_pid = st.proc.pid
        try:
            self._wait_ready(st)
        except BaseException:
            self._kill_sshd(st)
            raise

    def _wait_ready(self, st: _HostState) -> None:
        """Wait for a TCP accept and then a successful ``ssh true``; raise with sshd's stderr otherwise."""
        h, proc = st.host, st.proc
        assert proc is not None
        deadline = time.monotonic() + self.ready_timeout
        last = ""
        while True:
            rc = proc.poll()
            if rc is not None:
                log = self.sshd_log(h.name)
                if "Address already in use" in log or "Cannot bind any address" in log:
                    raise _PortInUse(f"port {h.port}: {log.strip()}")
                raise SshdError(f"sshd for {h.name!r} exited rc={rc} before accepting connections:\n{log}")
            if time.monotonic() > deadline:
                raise SshdError(f"sshd for {h.name!r} ({h.hostname}:{h.port}) not ready after "
                                f"{self.ready_timeout:.0f}s; last: {last}\nsshd stderr:\n{self.sshd_log(h.name)}")
            problem = _probe_ssh_port(h.hostname, h.port)
            if problem:
                last = problem
                time.sleep(0.05)
                continue
            left = max(1.0, deadline - time.monotonic())
            try:
                r = subprocess.run(h.ssh_argv("true", connect_timeout=max(1, min(5, int(left)))), capture_output=True,
                                   text=True, timeout=left, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                last = "ssh true timed out"
                continue
            if r.returncode == 0:
                return
            last = f"ssh true rc={r.returncode}: {r.stderr.strip()}"
            time.sleep(0.1)

    def start(self, name: str) -> FarmHost:
        """(Re)start a stopped host's sshd with the same address, port and host key (SshdError if the loopback
        port was taken meanwhile)."""
        st = self._state(name)
        if st.proc is not None and st.proc.poll() is None:
            return st.host
        self._start(st)
        return st.host

    def stop(self, name: str) -> None:
        """Kill that host's sshd and everything it spawned (open sessions and their commands), like a crash."""
        self._kill_sshd(self._state(name))

    def _kill_sshd(self, st: _HostState) -> None:
        proc = st.proc
        if proc is None:
            return
        pids = [proc.pid, *_descendants(proc.pid)]
        _kill(pids)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        _wait_gone(pids[1:], 5.0)
        st.proc = None

    # ---- network faults -------------------------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Take a netns host off the network (root-side veth down); its processes keep running.

        Traffic either way is dropped silently (connects time out, open TCP connections stall and resume on
        ``restore`` if they have not timed out meanwhile).
        """
        st = self._state(name)
        if st.link is None:
            raise NotImplementedError(f"host {name!r} is on loopback; only netns hosts can be cut")
        _run(["ip", "link", "set", st.link, "down"])
        st.is_cut = True

    def restore(self, name: str, *, timeout: float = 10.0) -> None:
        """Undo ``cut``: bring the root-side veth up and wait until the host's port answers again (if sshd runs)."""
        st = self._state(name)
        if st.link is None:
            raise NotImplementedError(f"host {name!r} is on loopback; only netns hosts can be cut")
        _run(["ip", "link", "set", st.link, "up"])
        st.is_cut = False
        if st.proc is None or st.proc.poll() is not None:
            return
        deadline = time.monotonic() + timeout
        while problem := _probe_ssh_port(st.host.hostname, st.host.port):
            if time.monotonic() > deadline:
                raise SshdError(f"host {name!r} not reachable {timeout:.0f}s after restore: {problem}")
            time.sleep(0.05)

    def is_cut(self, name: str) -> bool:
        """Whether ``cut(name)`` is in effect."""
        return self._state(name).is_cut

    # ---- known_hosts ----------------------------------------------------------------------------------------------

    def _known_hosts_lines(self, *, without: str | None = None, wrong: Mapping[str, str] | None = None) -> str:
        lines = []
        for n, st in self._hosts.items():
            if n == without or not st.host.port:
                continue
            key = (wrong or {}).get(n, st.host.host_public_key)
            lines.append(f"{st.host.known_hosts_pattern} {key}\n")
        return "".join(lines)

    def _write_known_hosts(self) -> None:
        tmp = self.known_hosts.with_suffix(".tmp")
        tmp.write_text(self._known_hosts_lines())
        os.replace(tmp, self.known_hosts)

    def known_hosts_without(self, name: str) -> Path:
        """A separate known_hosts file listing every host except ``name`` (for unknown-host-key tests)."""
        self._state(name)
        path = self.directory / f"known_hosts.without-{_safe(name)}"
        path.write_text(self._known_hosts_lines(without=name))
        return path

    def known_hosts_with_wrong_key(self, name: str) -> Path:
        """A separate known_hosts file where ``name`` has a freshly generated, different key (changed-key tests)."""
        self._state(name)
        keydir = Path(tempfile.mkdtemp(prefix="wrongkey-", dir=self.directory))
        wrong = _keygen(keydir / "key", f"hsx-wrong-{name}")
        path = self.directory / f"known_hosts.wrong-{_safe(name)}"
        path.write_text(self._known_hosts_lines(wrong={name: wrong}))
        return path

    # ---- teardown -------------------------------------------------------------------------------------------------

    def _discard(self, st: _HostState) -> None:
        """Remove a host whose setup failed half-way."""
        with contextlib.suppress(Exception):
            self._kill_sshd(st)
        ns = st.host.netns
        if ns and ns in self._namespaces:
            with contextlib.suppress(Exception):
                _delete_ns(ns)
            self._namespaces.remove(ns)
        for link in (st.link, f"hsxs{st.subnet}" if st.subnet is not None else None):
            if link and link in self._links:
                _run(["ip", "link", "del", link], check=False)
                self._links.remove(link)
        self._hosts.pop(st.host.name, None)
        with contextlib.suppress(Exception):
            self._write_known_hosts()

    def close(self) -> None:
        """Kill every sshd, delete namespaces and veth links, remove the temp dir. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for st in list(self._hosts.values()):
            with contextlib.suppress(Exception):
                self._kill_sshd(st)
        for ns in list(self._namespaces):
            with contextlib.suppress(Exception):
                _delete_ns(ns)
        for link in list(self._links):
            with contextlib.suppress(Exception):
                if Path(f"/sys/class/net/{link}").exists():
                    _run(["ip", "link", "del", link], check=False)
        leftover = set(self._namespaces) & set(_ns_list()) if self._namespaces else set()
        for ns in leftover:  # one more try; a namespace must never outlive the farm
            with contextlib.suppress(Exception):
                _delete_ns(ns)
        self._namespaces.clear()
        self._links.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


class _PortInUse(SshdError):
    """sshd could not bind its (loopback) port; add_host retries with another one."""


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
