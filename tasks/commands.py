"""Pure builders of every shell command sent to a host, and parsers of what they print.

Every interpolated value goes through `quote` (shlex.quote). Commands are POSIX sh; they are tested as
strings in tests/unit and run for real against sshd in tests/integration. The launch itself is a script
shipped in the bundle (tasks/launch.sh); `launch_cmd` calls it.

Remote layout under a host's `workdir`:
  bundles/<sha256>/        the unpacked code bundle (`.complete` holds the hash once it is whole)
  runs/<run>/<shard dir>/  one shard's control dir: launch.json, worker.log, pid, pid.start,
                           heartbeat.json, exit.json (the worker's --status-dir), spool/ (its --spool
                           with an s3:// output), aws-credentials (while the shard runs)
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

PROC_START_FIELD = 20  # starttime, counted after the ") " that ends /proc/PID/stat's comm field
CREDENTIALS_FILE = "aws-credentials"  # in a shard's control dir while it runs (tasks/credentials.py writes it)


def quote(value: object) -> str:
    """`value` as one shell word (shlex.quote of its text)."""
    return shlex.quote(str(value))


def bundle_dir(workdir: str, bundle_sha256: str) -> str:
    """Where a bundle is unpacked on a host."""
    return f"{workdir}/bundles/{bundle_sha256}"


RUN_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$"  # one directory name: never a path, never `..`


def control_dir(workdir: str, run: str, shard_dir: str) -> str:
    """`<workdir>/runs/<run>/<shard dir>`; ValueError for a run name that is not one plain directory name."""
    if not re.fullmatch(RUN_NAME_PATTERN, run) or not re.fullmatch(r"shard-\d{5}-of-\d{5}", shard_dir):
        raise ValueError(f"run name {run!r} / shard dir {shard_dir!r}: a run name is 1-200 of letters, digits, "
                         f"'.', '_', '-' (not first), so that runs/<run>/ stays one directory under the workdir")
    return f"{workdir}/runs/{run}/{shard_dir}"


def _proc_start(pid_expr: str, live: bool = False) -> str:
    """Shell that prints the start time (clock ticks after boot) of process `pid_expr`. `live`: nothing for a
    zombie (it ended; its parent has not reaped it yet). Without it a zombie's is printed, so that the stop and kill
    commands still signal whatever it left running in its process group."""
    keep = "/^Z /!p" if live else "p"
    return f"sed -n 's/.*) //; {keep}' /proc/{pid_expr}/stat 2>/dev/null | cut -d' ' -f{PROC_START_FIELD}"


def check_bundle_cmd(workdir: str, bundle_sha256: str, python: str, synthetic: bool = False) -> str:
    """Prints `BUNDLE <hash>` if that bundle is unpacked whole, then the worker's version through `python`, then
    the environment check it passed before (`env_check_cmd`'s line, kept with the bundle), if any."""
    d = bundle_dir(workdir, bundle_sha256)
    return (f"test -f {quote(d + '/.complete')} || {{ echo 'NO BUNDLE'; exit 4; }}; "
            f"printf 'BUNDLE %s\\n' \"$(cat {quote(d + '/.complete')})\" && "
            f"PYTHONPATH={quote(d + '/src')}${{PYTHONPATH:+:$PYTHONPATH}} {quote(python)} -m hsextract --version && "
            f"{{ cat {quote(d + _env_file(synthetic))} 2>/dev/null; true; }}")


def _env_file(synthetic: bool) -> str:
    return "/.env-synthetic" if synthetic else "/.env"


def bundle_tarball(workdir: str, bundle_sha256: str, nonce: str) -> str:
    """Where one deploy puts the bundle before unpacking (its own name: deploys of one bundle may overlap)."""
    return f"{bundle_dir(workdir, bundle_sha256)}.{nonce}.tar.gz"


def unpack_bundle_cmd(workdir: str, bundle_sha256: str, nonce: str) -> str:
    """Verify the uploaded tarball's sha256 on the host (prints `SHA256 <hash>`), unpack it atomically.

    Deploys of the same bundle to one workdir may overlap (two runs, or two inventory entries for one
    machine): each unpacks into its own temp dir, and the first to finish puts it in place."""
    d = bundle_dir(workdir, bundle_sha256)
    tar, part = bundle_tarball(workdir, bundle_sha256, nonce), f"{d}.partial.{nonce}"
    return (f"printf 'SHA256 %s\\n' \"$(sha256sum {quote(tar)} | cut -d' ' -f1)\" && "
            f"echo {quote(bundle_sha256 + '  ' + tar)} | sha256sum -c --status "
            f"|| {{ echo 'HASH MISMATCH'; rm -f {quote(tar)}; exit 3; }}; "
            f"rm -rf {quote(part)} && mkdir -p {quote(part)} && "
            f"tar --no-same-owner --no-same-permissions -xzf {quote(tar)} -C {quote(part)} && rm -f {quote(tar)} && "
            f"printf '%s' {quote(bundle_sha256)} > {quote(part + '/.complete')} && "
            f"{{ mv -T {quote(part)} {quote(d)} 2>/dev/null "
            f"|| {{ test -f {quote(d + '/.complete')} && rm -rf {quote(part)}; }} || "
            f"{{ rm -rf {quote(d)} && mv -T {quote(part)} {quote(d)}; }}; }}")


def env_check_cmd(python: str, workdir: str, bundle_sha256: str, synthetic: bool = False) -> str:
    """Prints `ENV {...}` (worker-side package versions, CUDA device count) and keeps it with the bundle. For
    synthetic workers (no model, no torch) the bundle's synthetic worker itself is what must import."""
    d = bundle_dir(workdir, bundle_sha256)
    if synthetic:
        code = ("import json, platform, hsextract.run.synthetic; print('ENV ' + json.dumps({'synthetic': True, "
                "'python': platform.python_version()}))")
        run = f"PYTHONPATH={quote(d + '/src')}${{PYTHONPATH:+:$PYTHONPATH}} {quote(python)} -c {quote(code)}"
    else:
        # then out at once: the interpreter's teardown of torch and transformers proves nothing and costs ~0.4 s
        code = ("import json, os, sys, torch, transformers, safetensors; print('ENV ' + json.dumps({'torch': "
                "torch.__version__, 'transformers': transformers.__version__, 'safetensors': safetensors.__version__, "
                "'cuda_devices': torch.cuda.device_count()}), flush=True); sys.stderr.flush(); os._exit(0)")
        run = f"{quote(python)} -c {quote(code)}"
    env = d + _env_file(synthetic)
    return f"{run} > {quote(env)}.$$.tmp && mv {quote(env)}.$$.tmp {quote(env)} && cat {quote(env)}"


def hsextract_cmd(workdir: str, bundle_sha256: str, python: str, args: list[str]) -> str:
    """`hsextract ARGS` from the bundle deployed on the host, through its `python`, every argument quoted."""
    d = bundle_dir(workdir, bundle_sha256)
    return (f"PYTHONPATH={quote(d + '/src')}${{PYTHONPATH:+:$PYTHONPATH}} {quote(python)} -m hsextract "
            + " ".join(quote(a) for a in args))


def preflight_cmd(workdir: str, bundle_sha256: str, python: str, options: list[str]) -> str:
    """`hsextract check` from the bundle with a shard's worker options: prints `CHECK {...}`, or exits 2
    naming what a shard would fail on (model, layers, dataset, output)."""
    return hsextract_cmd(workdir, bundle_sha256, python, ["check", *options]) + " </dev/null"


def launch_cmd(control: str, bundle: str, gpu: int, argv: list[str], journal: str, wait_s: float = 5.0,
               env: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> str:
    """Run the bundle's launch script (tasks/launch.sh: start the worker `argv` detached under a launch lock,
    or adopt the one alive), then, once it printed `LAUNCHED` or `ADOPT`, the probe (`probe_cmd`): launch and
    proof in one round trip. `bundle` is the unpacked bundle's directory on the host; `env` (never secrets:
    they would show in this command line) is set for the worker, the names in `unset` removed first."""
    for name in [*(env or {}), *unset]:
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            raise ValueError(f"environment variable name {name!r} is not allowed")
    settings = [f"{name}={value}" for name, value in (env or {}).items()] + [f"-{name}" for name in unset]
    words = [f"{bundle}/tasks/launch.sh", control, max(1, int(wait_s * 10)), gpu, *settings, "--", *argv]
    return f"sh {' '.join(quote(w) for w in words)} && {{ {probe_cmd(control, journal)}; }}"


def probe_cmd(control: str, journal: str, log: bool = True) -> str:
    """Everything supervise and a launch need of one shard in one round trip, in sections (parsed by
    `parse_probe`): `_probe_body`'s, the STARTED line included; `log`: with the worker log's tail."""
    return (f"now=$(date +%s.%N); {_probe_body(control, journal, started=True)}"
            + ("; echo '---LOG'; tail -c 3000 worker.log 2>/dev/null" if log else ""))


def _probe_body(control: str, journal: str, started: bool) -> str:
    """One shard's probe sections, with shell builtins rather than a process per file read: the clock comes
    from `$now` (read once per round trip); the STARTED line only when `started` (a launch waiting for its
    proof); the journal's last line only once there is an exit record (only a finished worker's is judged)."""
    return (
        f"cd {quote(control)} 2>/dev/null || {{ echo 'NO CONTROL DIR'; exit 0; }}; echo \"NOW $now\"; "
        f"pid=; {{ read -r pid < pid; }} 2>/dev/null; echo \"PID $pid\"; "
        f"ps=; {{ read -r ps < pid.start; }} 2>/dev/null; echo \"PIDSTART $ps\"; "
        f"st=; [ -n \"$pid\" ] && {{ read -r st < /proc/$pid/stat; }} 2>/dev/null; "
        f"if [ -n \"$st\" ]; then set -- ${{st##*) }}; echo \"STAT $1 ${{{PROC_START_FIELD}}}\"; fi; "
        f"echo '---STARTED'; " + ("grep -m1 '^STARTED' worker.log 2>/dev/null; " if started else "")
        + "echo '---HEARTBEAT'; hb=; { read -r hb < heartbeat.json; } 2>/dev/null; echo \"$hb\"; "
        "echo '---EXIT'; ex=; { read -r ex < exit.json; } 2>/dev/null; echo \"$ex\"; "
        f"echo '---JOURNAL'; if [ -n \"$ex\" ]; then tail -n 1 {quote(journal)} 2>/dev/null; fi; echo"
    )


def probe_many_cmd(shards: list[tuple[str, str, str] | tuple[str, str, str, bool]], nonce: str) -> str:
    """`probe_cmd` for many shards of one host in one round trip, without the log tails (a failure fetches its
    shard's with `probe_cmd`): `shards` is (key, control dir, journal[, launching]: then with its STARTED line);
    each shard's sections follow a line `===<nonce> <key>` (`nonce`: fresh per call, so nothing a worker wrote
    can pass for one; parsed by `parse_probe_many`). Cheap on the host: a handful of processes per round trip,
    not a dozen per shard (see `_probe_body`)."""
    parts = ["now=$(date +%s.%N)"]
    for key, control, journal, *launching in shards:
        body = _probe_body(control, journal, bool(launching and launching[0]))
        parts.append(f"echo {quote(f'==={nonce} {key}')}; ( {body} )")
    return "; ".join(parts) + f"; echo {quote(f'==={nonce} END')}"


def kill_cmd(control: str) -> str:
    """SIGKILL the shard's process group, only if pid and start time still match (no reused pid)."""
    return (f"cd {quote(control)} && pid=$(cat pid) && [ \"$({_proc_start('$pid')})\" = \"$(cat pid.start)\" ] && "
            f"{{ kill -KILL -\"$pid\" 2>/dev/null; kill -KILL \"$pid\" 2>/dev/null; echo KILLED; }}")


def stop_cmd(workdir: str, run: str, request: dict, grace_s: float, shards: list[int] | None = None) -> str:
    """Stop the workers of run `run` on this host (shards `shards`, or every shard dir the run has here):
    for each one alive as launched (pid and start time match), write `request` as its stop.json, SIGTERM its
    process group, and leave a detached sleeper on the host that SIGKILLs whatever of them is still that
    process after `grace_s` and removes its credentials file: the grace holds even if the orchestrator dies.
    Prints `TERM <shard dir> <pid>` per worker signalled, `IDLE <shard dir>` per one with no live worker."""
    dirs = " ".join(f"shard-{int(n):05d}-of-*" for n in shards) if shards is not None else "shard-*-of-*"
    body = json.dumps(request, separators=(",", ":"))
    # the sleeper's arguments: shard dir:pid:start of each signalled worker
    escalate = (f"sleep {max(0.0, grace_s):g}; for w in \"$@\"; do d=${{w%%:*}}; r=${{w#*:}}; p=${{r%%:*}}; "
                f"s=${{r#*:}}; if [ \"$({_proc_start('$p')})\" = \"$s\" ]; then kill -KILL -\"$p\" 2>/dev/null; "
                f"kill -KILL \"$p\" 2>/dev/null; echo \"KILLED $p after {grace_s:g}s\" >> \"$d/stop.log\"; fi; "
                f"rm -f \"$d/{CREDENTIALS_FILE}\"; done")
    return (f"cd {quote(f'{workdir}/runs/{run}')} 2>/dev/null || {{ echo 'NO RUN DIR'; exit 0; }}; "
            f"set --; for d in {dirs}; do [ -d \"$d\" ] || continue; "
            f"pid=$(cat \"$d/pid\" 2>/dev/null); start=$(cat \"$d/pid.start\" 2>/dev/null); "
            f"if [ -n \"$pid\" ] && [ -n \"$start\" ] && [ \"$({_proc_start('$pid')})\" = \"$start\" ]; then "
            f"printf '%s' {quote(body)} > \"$d/stop.json.tmp\" && mv \"$d/stop.json.tmp\" \"$d/stop.json\"; "
            f"kill -TERM -\"$pid\" 2>/dev/null || kill -TERM \"$pid\" 2>/dev/null; "
            f"echo \"TERM $d $pid\"; set -- \"$@\" \"$d:$pid:$start\"; "
            f"else echo \"IDLE $d\"; fi; done; "
            f"if [ $# -gt 0 ]; then nohup setsid sh -c {quote(escalate)} sh \"$@\" </dev/null >/dev/null 2>&1 & fi; "
            f"echo 'STOP SENT'")


def alive_cmd(workdir: str, run: str, shard_dirs: list[str]) -> str:
    """Prints `ALIVE <shard dir> <pid>` for each of `shard_dirs` whose worker is still the process launched."""
    return (f"cd {quote(f'{workdir}/runs/{run}')} 2>/dev/null || exit 0; "
            f"for d in {' '.join(quote(d) for d in shard_dirs)}; do pid=$(cat \"$d/pid\" 2>/dev/null); "
            f"[ -n \"$pid\" ] && [ \"$({_proc_start('$pid', live=True)})\" = "
            f"\"$(cat \"$d/pid.start\" 2>/dev/null)\" ] && "
            f"echo \"ALIVE $d $pid\"; done; echo 'CHECKED'")


@dataclass
class Probe:
    """Parsed `probe_cmd` output."""

    has_control_dir: bool = True
    now: float | None = None
    pid: int | None = None         # what the control dir's `pid` file says
    recorded_start: str = ""       # ... and its `pid.start` (the start time recorded at launch)
    state: str | None = None       # /proc state letter (R, S, D, T, Z...) of that pid, None if no such process
    proc_start: str = ""           # the start time /proc gives for that pid now
    started_line: str = ""
    heartbeat: dict | None = None
    exit: dict | None = None
    journal_last: dict | None = None
    log: str = ""
    sections: dict = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        """Running as the process we launched: exists, not a zombie, and not a reused pid."""
        return self.state is not None and self.state != "Z" and self.proc_start == self.recorded_start != ""

    @property
    def heartbeat_age(self) -> float | None:
        """Seconds since the heartbeat was written, by the host's clock (None without one)."""
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


def parse_probe_many(stdout: str, nonce: str) -> dict[str, Probe]:
    """The probes `probe_many_cmd` printed, by key; the output must end with its END line (a cut-off round trip
    reads as nothing)."""
    mark = f"\n==={nonce} "  # at a line's start: a worker's JSON holds no raw newline
    text = "\n" + stdout
    if f"{mark}END\n" not in text + "\n":
        return {}
    out = {}
    for chunk in text.split(f"{mark}END", 1)[0].split(mark)[1:]:
        key, _, body = chunk.partition("\n")
        out[key.strip()] = parse_probe(body)
    return out


def parse_probe(stdout: str) -> Probe:
    """The sections `probe_cmd` printed; absent or unparsable parts stay None or empty."""
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
            probe.recorded_start = value
        elif key == "STAT" and value:
            probe.state, _, probe.proc_start = value.partition(" ")
    probe.started_line = sections.get("STARTED", "").strip()
    probe.heartbeat = _json_or_none(sections.get("HEARTBEAT", ""))
    probe.exit = _json_or_none(sections.get("EXIT", ""))
    probe.journal_last = _json_or_none(sections.get("JOURNAL", ""))
    probe.log = sections.get("LOG", "")
    return probe


def facts_cmd(workdir: str, output_dir: str | None) -> str:
    """One round trip for the host's facts: its clock, free disk of the workdir (and of a local output), and the
    GPUs `nvidia-smi` lists (index, name, total and free MiB), in lines parsed by `parse_facts`."""
    def df(label: str, path: str) -> str:
        return (f"p={quote(path)}; while [ ! -d \"$p\" ]; do p=$(dirname \"$p\"); done; "
                f"echo \"DF {label} $(df -Pk \"$p\" | tail -n 1)\"")

    parts = ["echo \"NOW $(date +%s.%N)\"", df("workdir", workdir)]
    if output_dir:
        parts.append(df("output", output_dir))
    parts.append("if command -v nvidia-smi >/dev/null 2>&1; then echo '---GPUS'; nvidia-smi "
                 "--query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits 2>&1; "
                 "echo \"---END $?\"; else echo 'NO NVIDIA-SMI'; fi")
    return "; ".join(parts)


def parse_facts(text: str) -> dict:
    """`facts_cmd`'s output: {"now": float, "df": {label: (free bytes, mount)}, "gpus": [...] or None, "smi": ...}."""
    facts: dict = {"df": {}, "gpus": None, "smi": ""}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("NOW "):
            facts["now"] = float(line[4:])
        elif line.startswith("DF "):
            words = line.split()
            if len(words) >= 7 and words[5].isdigit():
                facts["df"][words[1]] = (int(words[5]) * 1024, words[7] if len(words) > 7 else "?")
        elif line == "NO NVIDIA-SMI":
            facts["smi"] = "nvidia-smi not found"
        elif line == "---GPUS":
            body: list[str] = []
            for rest in lines[i + 1:]:
                if rest.startswith("---END"):
                    if rest.split()[-1] != "0":
                        facts["smi"] = "nvidia-smi failed: " + (" ".join(" ".join(body).split())[:240] or "no output")
                        body = []
                    break
                body.append(rest)
            gpus = []
            for row in body:
                cells = [c.strip() for c in row.split(",")]
                if len(cells) == 4 and cells[0].isdigit() and cells[2].isdigit() and cells[3].isdigit():
                    gpus.append({"index": int(cells[0]), "name": cells[1], "total": int(cells[2]) << 20,
                                 "free": int(cells[3]) << 20})
            facts["gpus"] = gpus
    return facts
