"""Confine a worker's filesystem writes to its own shard (Linux Landlock), so no shard can write another's.

A worker may write only beneath: its shard's output directory (or, with an s3:// output, its spool), its
status directory, a private temp directory, the per-user caches that CUDA, Triton and Hugging Face keep
(unless one of them holds the output), and /dev and /proc. Reads are not restricted. Landlock applies to
the calling thread and every thread or process it starts later, so `confine` runs before the heartbeat
thread starts and before torch is imported.

Written against the three syscalls directly: the PyPI binding is a pre-release, and the kernel interface
is two small structs (include/uapi/linux/landlock.h).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hsextract.errors import HsExtractError, Retry

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same on x86_64 and aarch64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# filesystem access rights: the write side only (bit 0 execute, 2 read file, 3 read dir stay unhandled)
WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR = 1 << 1, 1 << 4, 1 << 5, 1 << 6
MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 7, 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_WRITES_V1 = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
              | MAKE_BLOCK | MAKE_SYM)

MODES = ("auto", "on", "off")
_SYSTEM = (Path("/dev"), Path("/proc"))  # device nodes (GPUs, /dev/null, /dev/shm), /proc/self


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class ConfineError(HsExtractError, OSError):
    """Landlock is missing or refused the ruleset (with mode "on" this stops the worker: exit 2, the same again
    fails the same)."""

    retry = Retry.NEVER


@dataclass(frozen=True)
class Confinement:
    """What `confine` did: `abi` 0 and `reason` when not confined."""

    abi: int
    writable: tuple[str, ...] = ()
    reason: str = ""

    @property
    def active(self) -> bool:
        """Whether writes are confined (Landlock took the ruleset)."""
        return self.abi > 0

    def describe(self) -> str:
        """The log line: what is writable, or why nothing is confined."""
        if not self.active:
            return f"writes NOT confined: {self.reason}"
        return f"writes confined to {', '.join(self.writable)} (Landlock ABI {self.abi})"


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none or it is disabled."""
    result = _libc().syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(0, result)


def _holds_any(path: Path, holds: list[Path]) -> bool:
    """Whether `path` is one of `holds` or an ancestor of one (then granting it would grant them)."""
    return any(hold == path or path in hold.parents for hold in holds)


def writable_dirs(own: list[Path], siblings_of: list[Path],
                  env: Mapping[str, str] | None = None) -> tuple[list[Path], Path]:
    """(directories to allow writes beneath, the temp directory to use).

    `own`: the shard's directories (always allowed, created first). `siblings_of`: directories holding other
    shards' directories; no allowed directory may be one of them or hold one. Shared places (the temp dir,
    user caches) are allowed only when they hold none of them; when the shared temp dir does, the shard
    gets a private one inside its last own directory (the status dir)."""
    env = os.environ if env is None else env
    own = [Path(os.path.realpath(p)) for p in own]
    holds = [Path(os.path.realpath(p)) for p in siblings_of]
    home = Path(env.get("HOME") or "~").expanduser()
    shared_tmp = Path(os.path.realpath(env.get("TMPDIR") or "/tmp"))
    caches = [Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache", home / ".triton",
              home / ".nv", *(Path(env[k]) for k in ("TRITON_CACHE_DIR", "HF_HOME", "CUDA_CACHE_PATH",
                                                       "TORCHINDUCTOR_CACHE_DIR") if env.get(k))]
    tmp = shared_tmp if not _holds_any(shared_tmp, holds) else own[-1] / "tmp"
    allowed = [*own, tmp, *_SYSTEM]
    for cache in caches:
        cache = Path(os.path.realpath(cache))
        if not _holds_any(cache, holds) and cache not in allowed:
            allowed.append(cache)
    return allowed, tmp


def confine(own: list[Path], siblings_of: list[Path], mode: str = "auto") -> Confinement:
    """Allow this process (and what it starts later) to write only beneath `writable_dirs(own, siblings_of)`.

    Sets TMPDIR to the temp directory chosen there. `mode` "off": nothing is done; "auto": confined when the
    kernel supports Landlock, else not (the returned reason says why); "on": ConfineError when it cannot be."""
    if mode not in MODES:
        raise ValueError(f"confine mode {mode!r}: choose one of {MODES}")
    if mode == "off":
        return Confinement(0, reason="--confine off")
    abi = landlock_abi()
    if abi == 0:
        why = f"the kernel ({os.uname().release}) has no Landlock, or it is disabled at boot"
        if mode == "on":
            raise ConfineError(errno.ENOSYS, f"--confine on: {why}")
        return Confinement(0, reason=why)
    allowed, tmp = writable_dirs(own, siblings_of)
    for path in allowed[len(own):]:
        if path not in _SYSTEM:  # the temp dir and the caches: made now, as their users would make them
            with contextlib.suppress(OSError):  # one that cannot be made is left out below (no fd to open)
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # recomputed from TMPDIR on next use
    handled = _WRITES_V1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    try:
        granted = _restrict(handled, allowed)
    except OSError as exc:
        if mode == "on":
            raise ConfineError(exc.errno or errno.EPERM, f"--confine on: Landlock refused the ruleset: {exc}") from None
        return Confinement(0, reason=f"Landlock refused the ruleset: {exc}")
    return Confinement(abi, tuple(str(p) for p in granted))


def _restrict(handled: int, allowed: list[Path]) -> list[Path]:
    libc = _libc()

    def check(result: int, what: str) -> int:
        if result < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")
        return result

    attr = ctypes.c_uint64(handled)  # struct landlock_ruleset_attr, first field only (older kernels' size)
    ruleset = check(libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0)),
                    "landlock_create_ruleset")
    granted = []
    try:
        for path in allowed:
            try:
                fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue  # absent: nothing to write beneath it anyway
            try:
                rule = _PathBeneath(handled, fd)
                check(libc.syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                   ctypes.byref(rule), ctypes.c_uint32(0)), f"landlock_add_rule {path}")
                granted.append(path)
            finally:
                os.close(fd)
        check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        check(libc.syscall(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return granted
