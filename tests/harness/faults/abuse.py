"""Abuse rows: injection into remote shells, object keys escaping the prefix, a shard writing another shard's
directories, file modes, and secrets at rest and in flight."""

from __future__ import annotations

import json
import re
import shutil
import stat
import sys
from pathlib import Path

from .hostrows import wrapper
from .lab import Case, Lab, Outcome, observed

# ---------------------------------------------------------------------------------------------------------------
# injection: every user-controlled string that reaches a remote shell, fuzzed, over a real sshd


def payloads(canary: str) -> list[str]:
    """Ways a value could smuggle `touch <canary>` into a shell command line."""
    run = f"touch {canary}"
    return [f";{run};", f"$({run})", f"`{run}`", f"'$({run})'", f'"$({run})"', f"\n{run}\n", f"&& {run}",
            f"|| {run} #", f"| tee {canary}", f"> {canary}", f"'; {run}; '", f'"; {run}; "', f"\\'; {run}; #",
            f"$'\\n'{run}", f"${{IFS}}touch${{IFS}}{canary}", f"\r{run}", f"\\\n{run}"]


RECORDER = """#!{python}
import json, os, sys
with open("argv.json", "w") as handle:  # the launch runs it in the shard's control dir
    json.dump({{"argv": sys.argv[1:], "region": os.environ.get("AWS_DEFAULT_REGION")}}, handle)
"""


def injection(lab: Lab, case: Case, examples: int = 40) -> Outcome:
    """Hypothesis builds values from shell metacharacters, quotes, newlines, unicode and `touch <canary>` payloads;
    each one is put into every field of every command the product sends to a host (workdir, python, run name,
    model, data, output, layers, environment values, put paths), which then runs over the real sshd of `lo`.
    Passes when the canary never appears, the worker's argv and environment arrive byte-identical, and a put
    lands at exactly the path given."""
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    from flows.extract import ROOT
    from tasks.commands import (RUN_NAME_PATTERN, bundle_dir, check_bundle_cmd, control_dir, env_check_cmd, kill_cmd,
                                launch_cmd, probe_cmd, unpack_bundle_cmd)
    from tasks.hosts import connect
    from tasks.inventory import load_inventory

    canary = case.base / "canary"
    inventory = load_inventory(case.inventory(("lo",)))
    text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=6)
    value = st.lists(st.one_of(st.sampled_from(payloads(str(canary))), text), min_size=1, max_size=3).map("".join)
    counts = {"examples": 0, "commands": 0, "argv_checked": 0, "run_names_refused": 0}
    host = connect(inventory.hosts[0], inventory)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(v=value, run=st.one_of(value, st.from_regex(RUN_NAME_PATTERN, fullmatch=True)))
    def attempt(v, run):
        assume(".." not in v.split("/") and len(v.encode()) < 120)
        counts["examples"] += 1
        root = case.base / f"ex{counts['examples']:04d}"
        workdir = f"{root}/w{v}"
        try:
            control = control_dir(workdir, run, "shard-00000-of-00001")
        except ValueError:
            assert not re.fullmatch(RUN_NAME_PATTERN, run), f"run name {run!r} refused but matches the pattern"
            counts["run_names_refused"] += 1
            control = control_dir(workdir, "fuzz", "shard-00000-of-00001")
        python = Path(f"{workdir}/bin{v}/python")
        python.parent.mkdir(parents=True, exist_ok=True)
        python.write_text(RECORDER.format(python=sys.executable))
        python.chmod(0o750)
        args = ["--model", v, "--data", f"/data/{v}", "--out", f"file:///out/{v}", "--layers", v]
        sha = "0" * 64
        bundle = Path(bundle_dir(workdir, sha))  # where deploy unpacks the bundle, with the launch script in it
        (bundle / "tasks").mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "tasks" / "launch.sh", bundle / "tasks" / "launch.sh")
        argv = [str(python), "-m", "hsextract", "extract", *args, "--status-dir", control]
        commands = [launch_cmd(control, str(bundle), 0, argv, f"{control}/j{v}", wait_s=1.0,
                               env={"AWS_DEFAULT_REGION": v}, unset=("AWS_PROFILE",)),
                    probe_cmd(control, f"{control}/j{v}"), kill_cmd(control), check_bundle_cmd(workdir, sha, str(python)),
                    env_check_cmd(str(python), workdir, sha), env_check_cmd(str(python), workdir, sha, True),
                    unpack_bundle_cmd(workdir, sha, v)]
        for command in commands:
            host.run(command, 30)
            counts["commands"] += 1
        recorded = json.loads((Path(control) / "argv.json").read_text())
        expected = ["-m", "hsextract", "extract", *args, "--status-dir", control]
        assert recorded == {"argv": expected, "region": v}, f"the worker got {recorded}, not {expected}"
        counts["argv_checked"] += 1
        host.put(b"fuzz", f"{workdir}/put{v}.bin", 30)
        assert Path(f"{workdir}/put{v}.bin").read_bytes() == b"fuzz", f"put of {workdir}/put{v!r}.bin went elsewhere"
        counts["commands"] += 1
        assert not canary.exists(), f"INJECTED: the canary exists after value {v!r} / run name {run!r}"

    try:
        attempt()
        verdict = "Completed" if not canary.exists() else "Failed: canary written"
    except AssertionError as exc:
        verdict = f"Failed: {' '.join(str(exc).split())}"
    finally:
        host.close()
    return Outcome(verdict, note=f"{counts['examples']} values x every field, {counts['commands']} commands over sshd, "
                                 f"argv round-tripped {counts['argv_checked']} times, {counts['run_names_refused']} run "
                                 f"names refused by the pattern; canary never written" if verdict == "Completed" else
                   f"{counts}")


# ---------------------------------------------------------------------------------------------------------------
# object keys


def key_escape(lab: Lab, case: Case) -> Outcome:
    """Outputs whose prefix could escape (`..`, `.`, empty segments, control characters) are refused before any
    launch; a journal in the store that names a path (`../../x`) is refused by the reader, and by the worker
    that would resume from it. (That every accepted prefix and name makes a key under the prefix is
    tests/unit/test_keys.py's property, over 400 generated pairs.)"""
    from hsextract.store import split_uri

    from .storagerows import Store

    findings = []
    for bad in ("s3://b-ok/run/../other", "s3://b-ok/./run", "s3://b-ok/a//b", "s3://b-ok/a\nb", "s3://B_bad/x"):
        try:
            split_uri(bad)
            findings.append(f"{bad!r} accepted")
        except ValueError:
            pass

    store = Store(lab, case)
    try:
        kwargs = dict(hosts=case.inventory(("lo",)), aws_credentials=store.block)
        state, seconds, why = case.flow(output=f"s3://{store.bucket}/run/../escape", **kwargs)
        refused = not state.is_completed() and "segment '..'" in why
        first, _, why_first = case.flow(output=store.output, **kwargs)
        if not first.is_completed():
            return Outcome(f"ERROR: the clean run failed: {why_first}")
        key = "run/shard-00000-of-00001/journal.jsonl"
        body = store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read()
        evil = {"kind": "file", "file": "../../../outside.safetensors", "ids": ["x"], "tokens": 1, "lengths": [1],
                "bytes": 1, "sha256": "0" * 64}
        store.client.put_object(Bucket=store.bucket, Key=key, Body=json.dumps(evil).encode() + b"\n" + body)
        import hsextract

        try:
            list(hsextract.read_samples(store.output, client=store.client))
            findings.append("the reader followed a journal naming ../../../outside.safetensors")
        except ValueError as exc:
            if "not a plain file name" not in str(exc):
                findings.append(f"the reader refused the journal for another reason: {exc}")
        state2, _, why2 = case.flow(output=store.output, shards=[0], **kwargs)
        store.client.put_object(Bucket=store.bucket, Key=key, Body=body)  # repaired: the re-run must complete
        rerun, _, why3 = case.flow(output=store.output, **kwargs)
    finally:
        store.close()
    if not refused:
        findings.append(f"output with '..' not refused before launch: {why or 'Completed'}")
    if state2.is_completed() or "not a plain file name" not in why2:
        findings.append(f"the worker resumed from a tampered journal: {why2 or 'Completed'}")
    verdict = f"ESCAPED: {'; '.join(findings)}" if findings else observed(state2, why2)
    return case.finish(verdict, seconds, None, store.output, client=store.client,
                       rerun="Completed" if rerun.is_completed() else f"Failed: {why3}",
                       note=f"prefix '..' refused before any launch ({seconds:.1f}s), 5 escaping prefixes refused; "
                            f"the reader too refused the tampered journal")


# ---------------------------------------------------------------------------------------------------------------
# a shard writing another shard's directories


EVIL = """import json, sys, time
from hsextract import cli
from hsextract.run import extract

real = extract.run_shard


def evil(cfg, *args, **kwargs):
    if cfg.shard == 0:  # shard 0 turns on its neighbour, once both are set up
        other_out = cfg.out_dir / "shard-00001-of-00002"
        other_ctrl = cfg.status_path.parent / "shard-00001-of-00002"
        deadline = time.time() + 60
        while not (other_out.is_dir() and other_ctrl.is_dir()) and time.time() < deadline:
            time.sleep(0.05)
        tried = {{}}
        for what, path in (("shard 1's output dir", other_out / "evil"), ("shard 1's journal", other_out / "journal.jsonl"),
                           ("shard 1's control dir", other_ctrl / "evil"), ("shard 1's heartbeat", other_ctrl / "heartbeat.json"),
                           ("the output root", cfg.out_dir / "shard-00009-of-00002"), ("the run's control dir", cfg.status_path.parent / "evil")):
            try:
                if what == "the output root":
                    path.mkdir()
                else:
                    with open(path, "a") as handle:
                        handle.write("evil\\n")
                tried[what] = "WRITTEN"
            except OSError as exc:
                tried[what] = "refused: " + (exc.strerror or str(exc))
        mine = cfg.shard_dir / "own-check"
        mine.write_text("ok")
        mine.unlink()
        (cfg.status_path / "evil.json").write_text(json.dumps(tried))
    return real(cfg, *args, **kwargs)


extract.run_shard = evil
sys.exit(cli.main(sys.argv[1:]))
"""


def shard_confined(lab: Lab, case: Case) -> Outcome:
    """Two shards on one host; shard 0's worker (the real CLI, its run_shard wrapped) tries to write into shard
    1's output and control dirs, the output root and the run's control dir, then extracts as usual."""
    evil = case.base / "evil.py"
    evil.write_text(EVIL.format())
    python = wrapper(case, f'shift 2; exec {sys.executable} {evil} "$@"')
    hosts = case.inventory(("lo",), gpus=(0, 1), lo={"python": python})
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
    record = case.control_dir("lo", 0, 2) / "evil.json"
    tried = json.loads(record.read_text()) if record.exists() else {}
    refused = [w for w, r in tried.items() if r.startswith("refused")]
    written = [w for w, r in tried.items() if r == "WRITTEN"]
    seen = observed(state, why)
    if written or not tried:
        seen = f"Failed: shard 0 wrote {written}" if written else "Failed: shard 0 never tried (no evil.json)"
    log = (case.control_dir("lo", 0, 2) / "worker.log").read_text(errors="replace")
    how = re.search(r"writes (NOT confined: .*|confined to .*\((Landlock ABI \d+)\))", log)
    errors = ", ".join(sorted({r.split(": ", 1)[-1] for r in tried.values()}))
    return case.finish(seen, None, {"hosts": case.inventory(("lo",), gpus=(0, 1), tag="fixed")}, case.local_out(),
                       note=f"{len(refused)} of {len(tried)} refused ({errors}); worker: "
                            f"{(how.group(2) or how.group(1)) if how else 'no confinement line in its log'}")


# ---------------------------------------------------------------------------------------------------------------
# file modes


def file_modes(lab: Lab, case: Case) -> Outcome:
    """A two-host run, then every path under every row's host workdirs and outputs: none may be readable,
    writable or searchable by others, none writable by the group."""
    state, _, why = case.flow(output=case.local_out(), hosts=case.inventory(("h1", "h2"), gpus=(0,)))
    roots = [p for p in lab.work.glob("*/w-*")] + [p for p in lab.work.glob("*/out") if p.is_dir()]
    open_paths, seen = [], 0
    for root in roots:
        for path in [root, *root.rglob("*")]:
            try:
                mode = path.lstat().st_mode
            except OSError:
                continue
            if stat.S_ISLNK(mode):
                continue
            seen += 1
            if mode & (stat.S_IRWXO | stat.S_IWGRP):
                open_paths.append(f"{oct(mode & 0o777)} {path.relative_to(lab.work)}")
    verdict = observed(state, why) if not open_paths else f"Failed: {len(open_paths)} open: {'; '.join(open_paths[:3])}"
    return case.finish(verdict, None, None, case.local_out(),
                       note=f"{seen} paths under {len(roots)} workdirs and outputs: none open to others or group-writable")


# ---------------------------------------------------------------------------------------------------------------
# secrets


def _every(fetch, page: int = 200) -> list:
    found, offset = [], 0
    while True:
        batch = fetch(limit=page, offset=offset)
        found += batch
        if len(batch) < page:
            return found
        offset += page


def prefect_texts(client) -> list[tuple[str, str]]:
    """(kind, text) of every log line, artifact, task and flow run state message and parameter set, and event
    the server kept; the kind of an event is its name."""
    from prefect.events.filters import EventFilter

    texts = [("log", log.message) for log in _every(client.read_logs)]
    texts += [("artifact", json.dumps(a.data, default=str) + (a.description or "")) for a in _every(client.read_artifacts)]
    texts += [("task run", f"{t.name} {(t.state.message or '') if t.state else ''}") for t in _every(client.read_task_runs)]
    texts += [("flow run", json.dumps(f.parameters, default=str) + ((f.state.message or '') if f.state else ""))
              for f in _every(client.read_flow_runs)]
    page = client.read_events(EventFilter(), limit=50)  # the server's most per page
    while page is not None:
        texts += [(e.event, e.model_dump_json()) for e in page.events]
        page = client.read_events_page(page.next_page) if page.next_page else None
    return texts


def secrets_at_rest(lab: Lab, case: Case) -> Outcome:
    """Every key the storage rows handed out, looked for in every file the matrix produced (hosts' workdirs,
    outputs, logs, the orchestrator rows' server database), in everything the Prefect server kept (logs,
    artifacts, task and flow run states and parameters, events), in what every row reported (the flow's
    exceptions), and in the argv and environment of every process while the rows ran.

    One exception, reported in the note: Prefect's own `prefect.block-document.*` events (emitted when a user
    saves the block, before any run) carry the block's plain fields, and prefect-aws declares the access key
    id a plain field; the secret key is masked there (the served server's database, which keeps those events,
    may hold the key id for the same reason). Every other place must hold neither."""
    from prefect.client.orchestration import get_client

    if not lab.secrets:
        return Outcome("Completed", note="no storage row ran: no secret to look for")
    hits, files = [], 0
    for path in lab.work.rglob("*"):
        if path.is_file() and not path.is_symlink():
            files += 1
            data = path.read_bytes()
            # the served server's own database stores those block-document events too (the cancel rows save
            # their block there): access key ids allowed in it, as in the events themselves
            own_db = path.name.startswith("prefect.db") and lab.served is not None and \
                path.is_relative_to(lab.served.root)
            hits += [f"{path}" for secret in lab.secrets if secret.encode() in data
                     and not (own_db and secret in lab.key_ids)]
    with get_client(sync_client=True) as client:
        texts = prefect_texts(client)
    block_events = {kind for kind, text in texts for s in lab.key_ids
                    if s in text and kind.startswith("prefect.block-document.")}
    hits += [f"{kind} {text[text.find(secret) - 200:text.find(secret) + 40]!r}" for kind, text in texts
             for secret in lab.secrets if secret in text
             and not (secret in lab.key_ids and kind.startswith("prefect.block-document."))]
    hits += [f"a row's report {text[:60]!r}" for text in lab.said for secret in lab.secrets if secret in text]
    hits += lab.argv_hits
    return Outcome("Failed: " + "; ".join(hits[:5]) if hits else "Completed", rerun="-",
                   note=f"{len(lab.secrets)} keys; {files} files, {len(texts)} Prefect records (logs, artifacts, "
                        f"runs, events), {len(lab.said) // 3} row reports, every process's argv and environment "
                        f"{'(watched)' if lab.watching else '(NOT watched)'}; access key ids only in Prefect's own "
                        f"{', '.join(sorted(block_events)) or 'nothing'}")
