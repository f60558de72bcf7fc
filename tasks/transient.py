"""Is an SSH failure worth retrying? `is_transient` answers from the exception (or error text) alone.

A pure function: no I/O, no network, no look-ups. paramiko and invoke are imported only to name their exception
types; without them the text rules still apply.

Order of the evidence, first decisive answer wins:
  1. a non-`Exception` (KeyboardInterrupt, SystemExit, ...) is never transient;
  2. the exception's type (table `_by_type`);
  3. its message text (table `RULES`: permanent rules before transient ones, so that text showing both a
     permanent cause and a transient symptom, e.g. OpenSSH's "Identity file ... No such file or directory"
     warning followed by "Connection refused", is permanent);
  4. the same for the exceptions it wraps: `__cause__`, then `__context__` (unless suppressed by
     `raise ... from None`), and the exceptions inside an invoke `ThreadException`.
Nothing decisive: not transient (an unknown failure is not retried blindly).
"""

from __future__ import annotations

import errno
import re
import socket

from hsextract.errors import Retry

try:  # only to name exception types
    from paramiko import ssh_exception as _pe
except ImportError:  # pragma: no cover - paramiko is an orchestrate dependency
    _pe = None
try:
    from invoke import exceptions as _ie
except ImportError:  # pragma: no cover
    _ie = None  # type: ignore[assignment]  # invoke is typed: _ie is its module; None: not installed

__all__ = ["is_transient", "retry_of", "RULES"]

# (pattern, transient?) over the message, case-insensitive; the first that matches decides. Where each text
# comes from is in the comment; tests/unit/test_transient.py produces most of them for real.
_PERMANENT = [
    # Authentication: paramiko "Authentication failed.", OpenSSH "u@host: Permission denied (publickey)."
    r"authentication failed",
    r"permission denied",
    r"too many authentication failures",
    r"no authentication methods available",  # paramiko: no key/password given at all
    # Host keys: paramiko BadHostKeyException "Host key for server 'h' does not match: ...",
    # paramiko RejectPolicy "Server '[h]:p' not found in known_hosts",
    # OpenSSH "WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!", "No ECDSA host key is known for [h]:p and you
    # have requested strict checking.", "Host key verification failed."
    r"remote host identification has changed",
    r"host key verification failed",
    r"host key for .* (does not match|has changed)",
    r"not found in known_hosts",
    r"no \S+ host key is known for",
    r"bad host key",
    # Permanent DNS answers (glibc gai_strerror of EAI_NONAME / EAI_NODATA / EAI_FAIL; macOS wording).
    r"name or service not known",
    r"no address associated with hostname",
    r"non-recoverable failure in name resolution",
    r"nodename nor servname provided",
    # Local files and keys: "No such file or directory", OpenSSH 'Load key "k": invalid format' /
    # 'error in libcrypto' / 'bad permissions' / "UNPROTECTED PRIVATE KEY FILE", paramiko "not a valid RSA
    # private key file", "base64 decoding error: ...", "Invalid key", "private key file is encrypted",
    # "Bad password or corrupt private key file".
    r"no such file or directory",
    r"invalid format",
    r"unprotected private key file",
    r"load key \"[^\"]*\": ",  # OpenSSH: invalid format / bad permissions / error in libcrypto / ...
    r"not a valid \S+ private key file",
    r"base64 decoding error",
    r"invalid (public )?key",
    r"private key file is encrypted",
    r"bad passphrase|incorrect passphrase|bad password or corrupt",
    # Nothing in common with the server: OpenSSH "Unable to negotiate with ...", paramiko IncompatiblePeer.
    r"unable to negotiate",
    r"incompatible ssh peer",
    r"bad configuration option",
    # invoke UnexpectedExit rendered as text: the remote command ran and exited non-zero (but see _NO_EXIT_STATUS).
    r"encountered a bad command exit code",
]
# ... unless its exit code is -1, paramiko's "no exit status received": the connection dropped mid-command.
_NO_EXIT_STATUS = r"encountered a bad command exit code.*^exit code: -1$"
_TRANSIENT = [
    r"connection refused",  # OpenSSH "ssh: connect to host h port p: Connection refused", ECONNREFUSED
    r"connection reset",  # "Connection reset by peer", OpenSSH "Connection reset by h port p"
    r"connection closed by",  # OpenSSH "kex_exchange_identification: Connection closed by remote host"
    r"closed by remote host",
    r"connection aborted|software caused connection abort",
    r"broken pipe",
    r"timed out|timeout",  # "Connection timed out during banner exchange", "timed out", "Timeout opening channel."
    r"not responding",  # OpenSSH ServerAlive "Timeout, server h not responding."
    r"did not complete within",  # invoke CommandTimedOut
    r"network is unreachable|network is down",
    r"no route to host|host is down",
    r"temporary failure in name resolution",  # glibc EAI_AGAIN
    r"error reading ssh protocol banner",  # paramiko: peer closed / silent / reset before its banner
    r"banner exchange",
    r"eof during negotiation",  # paramiko SFTP: channel closed before the version exchange
    r"ssh session not active",  # paramiko exec_command on a dead transport
    r"no existing session",  # paramiko auth/open on a dead transport
    r"channel closed|channel is not open",  # paramiko "Channel closed."
    r"socket is closed",
    r"server connection dropped",
    r"unable to connect to port",  # paramiko NoValidConnectionsError "Unable to connect to port p on h"
    r"exceeded maxstartups",  # sshd throttling unauthenticated connections: "Exceeded MaxStartups"
    r"resource temporarily unavailable",
]
RULES: list[tuple[re.Pattern[str], bool]] = [
    *((re.compile(p, re.I), False) for p in _PERMANENT[:-1]),
    (re.compile(_NO_EXIT_STATUS, re.I | re.S | re.M), True),
    (re.compile(_PERMANENT[-1], re.I), False),
    *((re.compile(p, re.I), True) for p in _TRANSIENT),
]

_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, n) for n in ("ECONNREFUSED", "ECONNRESET", "ECONNABORTED", "ETIMEDOUT", "ENETUNREACH",
                                "EHOSTUNREACH", "ENETDOWN", "EHOSTDOWN", "ENETRESET", "EPIPE")
    if hasattr(errno, n))
_GAI_TRANSIENT = frozenset(getattr(socket, n) for n in ("EAI_AGAIN",) if hasattr(socket, n))
_GAI_PERMANENT = frozenset(getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL")
                           if hasattr(socket, n))


def _by_text(text: str) -> bool | None:
    for pattern, blip in RULES:
        if pattern.search(text):
            return blip
    return None


def _by_type(e: BaseException) -> bool | None:
    if _pe is not None:
        # BadHostKeyException and the AuthenticationException family (BadAuthenticationType,
        # PartialAuthentication, PasswordRequiredException, UnableToAuthenticate) subclass SSHException: first.
        if isinstance(e, (_pe.BadHostKeyException, _pe.AuthenticationException, _pe.IncompatiblePeer,
                          _pe.ConfigParseError, _pe.CouldNotCanonicalize)):
            return False
        if isinstance(e, _pe.NoValidConnectionsError):  # every address refused / unreachable / timed out
            return True
    if _ie is not None:
        if isinstance(e, _ie.CommandTimedOut):
            return True
        if isinstance(e, _ie.UnexpectedExit):
            # The command ran and exited non-zero: retrying runs it again to the same end. Exit -1 is paramiko's
            # "no exit status received": the connection (or the remote sshd) went away mid-command.
            exited = getattr(getattr(e, "result", None), "exited", None)
            return exited == -1
        if isinstance(e, _ie.AuthFailure):  # sudo password rejected
            return False
    if isinstance(e, socket.gaierror):
        if e.errno in _GAI_TRANSIENT:
            return True
        if e.errno in _GAI_PERMANENT:
            return False
        return None
    if isinstance(e, (TimeoutError, ConnectionError, EOFError)):  # socket.timeout is TimeoutError (3.10+)
        return True
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    return None


def _wrapped(e: BaseException) -> list[BaseException]:
    inner: list[BaseException] = []
    if e.__cause__ is not None:
        inner.append(e.__cause__)
    if e.__context__ is not None and not e.__suppress_context__:
        inner.append(e.__context__)
    if _ie is not None and isinstance(e, _ie.ThreadException):
        inner.extend(w.value for w in e.exceptions if isinstance(getattr(w, "value", None), BaseException))
    return inner


def is_transient(error: BaseException | str) -> bool:
    """True if a retry may cure this SSH failure (the network, the host's sshd being busy or restarting, a dropped
    connection), False if it cannot (authentication, host keys, permanent DNS answers, missing or bad key files,
    a remote command that exited non-zero) or if nothing in it is recognised. See the module docstring."""
    if isinstance(error, str):
        return bool(_by_text(error))
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit, GeneratorExit, ...
        return False
    seen: set[int] = set()
    queue: list[BaseException] = [error]
    while queue and len(seen) < 32:
        e = queue.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        verdict = _by_type(e)
        if verdict is None:
            verdict = _by_text(str(e))
        if verdict is not None:
            return verdict
        queue.extend(_wrapped(e))
    return False


def retry_of(error: BaseException | str) -> Retry:
    """`Retry.NOW` for an SSH failure a retry may cure at once (`is_transient`), else `Retry.LATER`: nothing in an
    SSH failure alone says that a later re-run cannot help."""
    return Retry.NOW if is_transient(error) else Retry.LATER
