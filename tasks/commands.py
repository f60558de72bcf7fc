"""Pure builders of every shell command sent to a host, and parsers of what they print.

Every interpolated value goes through `q` (shlex.quote). Commands are POSIX sh; they are tested as
strings in tests/unit and run for real against sshd in tests/integration.

Remote layout under a host's `workdir`:
  bundles/<sha256>/        the unpacked code bundle (`.complete` holds the hash once it is whole)
  runs/<run>/<shard dir>/  one shard's control dir: launch.json, worker.log, pid, pid.start,
                           heartbeat.json, exit.json (the worker's --status-dir)
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

PROC_START_FIELD = 20  # starttime, counted after the ") " that ends /proc/PID/stat's comm field


def q(value: object) -> str:
    return shlex.quote(str(value))


def bundle_dir(workdir: str, digest: str) -> str:
    return f"{workdir}/bundles/{digest}"


RUN_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$"  # one directory name: never a path, never `..`


def control_dir(workdir: str, run: str, shard_dir: str) -> str:
    if not re.fullmatch(RUN_NAME_PATTERN, run) or not re.fullmatch(r"shard-\d{5}-of-\d{5}", shard_dir):
        raise ValueError(f"run name {run!r} / shard dir {shard_dir!r}: a run name is 1-200 of letters, digits, "
                         f"'.', '_', '-' (not first), so that runs/<run>/ stays one directory under the workdir")
    return f"{workdir}/runs/{run}/{shard_dir}"


def _proc_start(pid_expr: str) -> str:
    return f"sed 's/.*) //' /proc/{pid_expr}/stat 2>/dev/null | cut -d' ' -f{PROC_START_FIELD}"


def _proc_state(pid_expr: str) -> str:
    return f"sed 's/.*) //' /proc/{pid_expr}/stat 2>/dev/null | cut -d' ' -f1"


def check_bundle_cmd(workdir: str, digest: str, python: str) -> str:
    """Prints `BUNDLE <hash>` if that bundle is unpacked whole, then the worker's version through `python`."""
    d = bundle_dir(workdir, digest)
    return (f"test -f {q(d + '/.complete')} || {{ echo 'NO BUNDLE'; exit 4; }}; "
            f"printf 'BUNDLE %s\\n' \"$(cat {q(d + '/.complete')})\" && "
            f"PYTHONPATH={q(d + '/src')}${{PYTHONPATH:+:$PYTHONPATH}} {q(python)} -m hsextract --version && "
            f"{{ cat {q(d + '/.env')} 2>/dev/null; true; }}")


def bundle_tarball(workdir: str, digest: str, nonce: str) -> str:
    """Where one deploy puts the bundle before unpacking (its own name: deploys of one bundle may overlap)."""
    return f"{bundle_dir(workdir, digest)}.{nonce}.tar.gz"


def unpack_bundle_cmd(workdir: str, digest: str, nonce: str) -> str:
    """Verify the uploaded tarball's sha256 on the host (prints `SHA256 <hash>`), unpack it atomically.

    Deploys of the same bundle to one workdir may overlap (two runs, or two inventory entries for one
    machine): each unpacks into its own temp dir, and the first to finish puts it in place."""
    d = bundle_dir(workdir, digest)
    tar, part = bundle_tarball(workdir, digest, nonce), f"{d}.partial.{nonce}"
    return (f"printf 'SHA256 %s\\n' \"$(sha256sum {q(tar)} | cut -d' ' -f1)\" && "
            f"echo {q(digest + '  ' + tar)} | sha256sum -c --status || {{ echo 'HASH MISMATCH'; rm -f {q(tar)}; exit 3; }}; "
            f"rm -rf {q(part)} && mkdir -p {q(part)} && "
            f"tar --no-same-owner --no-same-permissions -xzf {q(tar)} -C {q(part)} && rm -f {q(tar)} && "
            f"printf '%s' {q(digest)} > {q(part + '/.complete')} && "
            f"{{ mv -T {q(part)} {q(d)} 2>/dev/null || {{ test -f {q(d + '/.complete')} && rm -rf {q(part)}; }} || "
            f"{{ rm -rf {q(d)} && mv -T {q(part)} {q(d)}; }}; }}")


def env_check_cmd(python: str, workdir: str, digest: str) -> str:
    """Prints `ENV {...}` (worker-side package versions, CUDA device count) and keeps it with the bundle."""
    code = ("import json, torch, transformers, safetensors; print('ENV ' + json.dumps({'torch': torch.__version__, "
            "'transformers': transformers.__version__, 'safetensors': safetensors.__version__, "
            "'cuda_devices': torch.cuda.device_count()}))")
    env = bundle_dir(workdir, digest) + "/.env"
    return f"{q(python)} -c {q(code)} > {q(env)}.$$.tmp && mv {q(env)}.$$.tmp {q(env)} && cat {q(env)}"


def launch_cmd(ctrl: str, workdir: str, digest: str, python: str, gpu: int, worker_args: list[str],
               journal: str, wait_s: float = 5.0, env: dict[str, str] | None = None,
               unset: tuple[str, ...] = ()) -> str:
    """Start the worker detached (setsid, stdio to worker.log, stdin /dev/null) under a launch lock.

    Prints `ADOPT <pid> <start>` when the shard's worker is already alive (same pid and start time),
    else `LAUNCHED <pid> <start>` after waiting on the host up to `wait_s` for its STARTED line and first
    heartbeat (or its death), then the probe (see `probe_cmd`): launch and proof in one round trip.
    `LOCK BUSY` or `LOG UNWRITABLE` with a non-zero exit otherwise. `env` (never secrets: they would show
    in /proc/PID/environ only to the owner, but in this command line to anyone who sees it) is set for the
    worker, and the variables in `unset` are removed from its environment first.
    """
    for name in [*(env or {}), *unset]:
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            raise ValueError(f"environment variable name {name!r} is not allowed")
    assign = "".join(f"{name}={q(value)} " for name, value in (env or {}).items())
    clear = f"unset {' '.join(unset)}; " if unset else ""
    ticks = max(1, int(wait_s * 10))
    src = bundle_dir(workdir, digest) + "/src"
    argv = " ".join(q(a) for a in [python, "-m", "hsextract", "extract", *worker_args, "--status-dir", ctrl])
    return (
        f"mkdir -p {q(ctrl)} && cd {q(ctrl)} && exec 9>>.launch.lock && "
        f"{{ flock -w 30 9 || {{ echo 'LOCK BUSY'; exit 75; }}; }} && "
        f"if [ -s pid ] && kill -0 \"$(cat pid)\" 2>/dev/null && [ \"$({_proc_state('$(cat pid)')})\" != Z ] && "
        f"[ \"$({_proc_start('$(cat pid)')})\" = \"$(cat pid.start 2>/dev/null)\" ]; then "
        f"echo \"ADOPT $(cat pid) $(cat pid.start)\"; exit 0; fi; "
        f"rm -f exit.json heartbeat.json pid pid.start && "
        f"{{ : > worker.log; }} 2>/dev/null || {{ echo 'LOG UNWRITABLE'; exit 73; }}; "
        f"{clear}{assign}CUDA_VISIBLE_DEVICES={q(gpu)} PYTHONPATH={q(src)}${{PYTHONPATH:+:$PYTHONPATH}} "
        f"PYTHONUNBUFFERED=1 "
        f"setsid {argv} >> worker.log 2>&1 < /dev/null 9>&- & "
        f"pid=$!; start=$({_proc_start('$pid')}); echo \"$pid\" > pid; echo \"$start\" > pid.start; "
        f"echo \"LAUNCHED $pid $start\"; i=0; while [ $i -lt {ticks} ]; do "
        f"if grep -q '^STARTED' worker.log 2>/dev/null && [ -s heartbeat.json ]; then break; fi; "
        f"kill -0 \"$pid\" 2>/dev/null || break; sleep 0.1; i=$((i+1)); done; "
        f"{probe_cmd(ctrl, journal)}"
    )


def probe_cmd(ctrl: str, journal: str) -> str:
    """Everything supervise needs in one round trip, in sections (parsed by `parse_probe`)."""
    return (
        f"cd {q(ctrl)} 2>/dev/null || {{ echo 'NO CONTROL DIR'; exit 0; }}; "
        f"echo \"NOW $(date +%s.%N)\"; pid=$(cat pid 2>/dev/null); echo \"PID $pid\"; "
        f"echo \"PIDSTART $(cat pid.start 2>/dev/null)\"; "
        f"if [ -n \"$pid\" ] && [ -r /proc/$pid/stat ]; then "
        f"echo \"STAT $(sed 's/.*) //' /proc/$pid/stat | cut -d' ' -f1,{PROC_START_FIELD})\"; fi; "
        f"echo '---STARTED'; grep -m1 '^STARTED' worker.log 2>/dev/null; "
        f"echo '---HEARTBEAT'; cat heartbeat.json 2>/dev/null; echo; "
        f"echo '---EXIT'; cat exit.json 2>/dev/null; echo; "
        f"echo '---JOURNAL'; tail -n 1 {q(journal)} 2>/dev/null; echo; "
        f"echo '---LOG'; tail -c 3000 worker.log 2>/dev/null"
    )


def kill_cmd(ctrl: str) -> str:
    """SIGKILL the shard's process group, only if pid and start time still match (no reused pid)."""
    return (f"cd {q(ctrl)} && pid=$(cat pid) && [ \"$({_proc_start('$pid')})\" = \"$(cat pid.start)\" ] && "
            f"{{ kill -KILL -- -\"$pid\" 2>/dev/null; kill -KILL \"$pid\" 2>/dev/null; echo KILLED; }}")


@dataclass
class Probe:
    """Parsed `probe_cmd` output."""

    has_control_dir: bool = True
    now: float | None = None
    pid: int | None = None
    pid_start: str = ""
    state: str | None = None       # /proc state letter (R, S, D, T, Z...) or None if no such process
    start: str = ""
    started_line: str = ""
    heartbeat: dict | None = None
    exit: dict | None = None
    journal_last: dict | None = None
    log: str = ""
    sections: dict = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        """Running as the process we launched: exists, not a zombie, and not a reused pid."""
        return self.state is not None and self.state != "Z" and self.start == self.pid_start != ""

    @property
    def heartbeat_age(self) -> float | None:
        if self.heartbeat is None or self.now is None:
            return None
        return self.now - float(self.heartbeat.get("time", 0))


def _json_or_none(text: str) -> dict | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None  # half-written is impossible (atomic renames); anything else is not ours
    return value if isinstance(value, dict) else None


def parse_probe(stdout: str) -> Probe:
    if stdout.startswith("NO CONTROL DIR"):
        return Probe(has_control_dir=False)
    head, *rest = stdout.split("\n---")
    sections = {}
    for chunk in rest:
        name, _, body = chunk.partition("\n")
        sections[name.strip()] = body
    probe = Probe(sections=sections)
    for line in head.splitlines():
        key, _, value = line.partition(" ")
        value = value.strip()
        if key == "NOW" and value:
            probe.now = float(value)
        elif key == "PID" and value.isdigit():
            probe.pid = int(value)
        elif key == "PIDSTART":
            probe.pid_start = value
        elif key == "STAT" and value:
            probe.state, _, probe.start = value.partition(" ")
    probe.started_line = sections.get("STARTED", "").strip()
    probe.heartbeat = _json_or_none(sections.get("HEARTBEAT", ""))
    probe.exit = _json_or_none(sections.get("EXIT", ""))
    probe.journal_last = _json_or_none(sections.get("JOURNAL", ""))
    probe.log = sections.get("LOG", "")
    return probe
