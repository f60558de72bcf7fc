"""`hsextract` command line (the CLI contract). Prints `STARTED` before importing anything heavy."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from hsextract import __version__
from hsextract.errors import USAGE_EXIT, Retry
from hsextract.options import EXPORT_FORMATS, WorkerOptions
from hsextract.run.liveness import Heartbeat, Progress, announce_start
from hsextract.say import shard_log
from hsextract.store.s3 import KEY_ENV


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand: extract and check (from WorkerOptions), inspect, make-tiny."""
    parser = argparse.ArgumentParser(prog="hsextract", description="Extract hidden states for drafter training.")
    parser.add_argument("--version", action="version", version=f"hsextract {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    WorkerOptions.add_arguments(sub.add_parser("extract", help="run one shard of an extraction"))
    check = sub.add_parser("check", help="check what a shard of these options needs (model config, layers, "
                                         "dataset, output) without loading the model; exit 2 naming the problem")
    WorkerOptions.add_arguments(check)
    check.add_argument("--probe-output", action="store_true",
                       help="also write, read back and delete a small object under --out (its credentials)")
    check.add_argument("--sample-tokens", type=int, default=0, metavar="N",
                       help="also count the dataset's samples, and its tokens on N records spread over it")
    check.add_argument("--report", action="store_true",
                       help="run every check (model, dataset, output) on its own and print each verdict; exit 0")

    inspect = sub.add_parser("inspect", help="count and verify what an output (directory or s3://) holds")
    inspect.add_argument("out", help="output directory, file:// or s3:// URI")
    inspect.add_argument("--verify", action="store_true", help="check every file's sha256 against the journal")

    fsck = sub.add_parser("fsck", help="list every problem of an output; --repair mends them, losing no good sample")
    fsck.add_argument("out", help="output directory, file:// or s3:// URI")
    fsck.add_argument("--repair", action="store_true",
                      help="cut bad journal lines, retract missing or corrupt files (their samples are redone), "
                           "remove stray files and a seal that does not hold")
    fsck.add_argument("--verify", action="store_true", help="also check every batch file's checksum (reads them)")
    _add_export(sub)
    _add_stage(sub)

    tiny = sub.add_parser("make-tiny", help="build a tiny random Qwen3.5 hybrid model and a chat dataset")
    tiny.add_argument("--model", type=Path, required=True, help="directory to save the model and tokenizer in")
    tiny.add_argument("--data", type=Path, required=True, help="JSONL file to write")
    tiny.add_argument("--samples", type=int, default=200)
    return parser


def _add_export(sub) -> None:
    """`hsextract export SRC DEST --format ...`."""
    export = sub.add_parser("export", help="write an output in a drafter trainer's offline layout "
                                           "(SpecForge DFlash / EAGLE-3, speculators)")
    export.add_argument("src", help="extraction output: directory, file:// or s3:// URI")
    export.add_argument("dest", type=Path, help="a new local directory (or one this command left unfinished)")
    export.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    export.add_argument("--max-length", type=int, default=None,
                        help="the trainer's max length: samples are cut to it, then judged")
    export.add_argument("--verify", action="store_true",
                        help="check every file's sha256 against the journal (by default a fast xxh3 checksum)")
    export.add_argument("--no-verify", action="store_true", help="check each file's size only")
    export.add_argument("--allow-partial", action="store_true",
                        help="export an output that is not sealed (export.json says what is missing)")


def _add_stage(sub) -> None:
    """`hsextract stage ACTION --cache ... --manifest ...` (what the orchestrator runs on a host)."""
    stage = sub.add_parser("stage", help="stage a source (a dataset or model in S3 or sent over SFTP) into this "
                                         "host's content-addressed cache, verified against its manifest")
    stage.add_argument("action", choices=("status", "fetch", "place", "prune"),
                       help="status: bytes missing and free space; fetch: from S3 (ranged GETs); place: verify "
                            "what was sent into the partial files and make it the blobs; prune: remove what no "
                            "staging used for --older-than-days (the --manifest sources kept)")
    stage.add_argument("--cache", type=Path, required=True, help="the cache directory (<workdir>/inputs)")
    stage.add_argument("--manifest", type=Path, action="append", default=[],
                       help="a source's manifest (JSON); one per source, repeated")
    stage.add_argument("--older-than-days", type=float, default=14.0,
                       help="prune: the views, blobs and partial files unused for this long (default 14)")
    stage.add_argument("--dry-run", action="store_true", help="prune: say what would go, remove nothing")
    stage.add_argument("--host", default="this host", help="this host's name, for the messages")
    stage.add_argument("--s3-endpoint", default=None)
    stage.add_argument("--aws-credentials-file", type=Path, default=None,
                       help="S3 keys for this process (a 0600 file, removed when it ends)")
    stage.add_argument("--threads", type=int, default=8, help="ranged GETs in flight")
    stage.add_argument("--part-mib", type=int, default=16, help="bytes per ranged GET, in MiB")
    stage.add_argument("--follow", metavar="NONCE", default=None,
                       help="place: hash the files while they arrive (until partial/NONCE.abort appears)")


def use_credentials_file(opts: WorkerOptions) -> None:
    """S3 keys for this process only: boto3 reads the file --aws-credentials-file names, and no key inherited
    from the environment can be used instead."""
    if opts.aws_credentials_file is not None:
        for name in KEY_ENV:
            os.environ.pop(name, None)
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(opts.aws_credentials_file)


def remove_credentials_file(opts: WorkerOptions) -> None:
    """The file --aws-credentials-file named lives only as long as this worker (the orchestrator removes it too)."""
    if opts.aws_credentials_file is not None:
        opts.aws_credentials_file.unlink(missing_ok=True)


def confine_shard(opts: WorkerOptions):
    """Landlock: this shard writes beneath its own directories only (see hsextract.run.confine). Its output dir
    (with s3://, its spool) and status dir are made first; the dirs that hold the other shards' are never
    writable: the output root, and the parent of the status dir when the orchestrator gave one."""
    from hsextract.run.confine import confine

    own = [opts.out_dir if opts.upload else opts.shard_dir, opts.status_path]
    with contextlib.suppress(OSError):  # one that cannot be made is reported by the checks that follow
        own[0].mkdir(parents=True, exist_ok=True)
    holds = ([] if opts.upload else [opts.out_dir]) + ([opts.status_path.parent] if opts.status_dir else [])
    return confine(own, holds, opts.confine)


#: packages transformers imports whenever they are installed, which no step of the worker uses: scikit-learn
#: (transformers' assisted generation imports it at module level; 1.3 s of a GPU host's start, where its image
#: has it)
UNUSED_PACKAGES = ("sklearn",)


def hide_unused_packages() -> None:
    """Make `UNUSED_PACKAGES` look not installed to this worker process (an import of one raises ImportError,
    `importlib.util.find_spec` says None), so that transformers does not import them; one imported already stays."""
    for name in UNUSED_PACKAGES:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # None: not importable; typeshed omits it


def extract(opts: WorkerOptions, capture=None) -> int:
    """`hsextract extract`: the STARTED line, the heartbeat, confinement, then the shard (`run_shard`)."""
    announce_start(opts.shard, opts.num_shards, __version__)
    use_credentials_file(opts)
    try:
        return _extract(opts, capture)
    finally:
        remove_credentials_file(opts)


def _extract(opts: WorkerOptions, capture) -> int:
    try:
        opts.check_out()  # the rest is checked by run_shard, which reports a problem in exit.json too
    except ValueError as exc:
        print(f"hsextract: {exc}", file=sys.stderr)
        return USAGE_EXIT
    from hsextract.errors import BUSY_EXIT, ShardBusy
    from hsextract.run.shard import take_lock

    try:  # before anything of this worker's is written: a second worker of a live shard touches none of its files
        take_lock(opts)
    except ShardBusy as exc:
        print(f"hsextract: {exc}: not started (exit {BUSY_EXIT})", file=sys.stderr)
        return BUSY_EXIT
    except OSError as exc:
        print(f"hsextract: --out {str(opts.out_dir)!r}: not writable: cannot lock {opts.shard_dir} "
              f"({exc.strerror or exc})", file=sys.stderr)
        return USAGE_EXIT
    heartbeat = Heartbeat(opts.status_path, Progress(opts.shard, opts.num_shards, __version__), opts.heartbeat_interval)
    try:
        opts.status_path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        label = "--status-dir" if opts.status_dir else "--out"
        print(f"hsextract: {label} {str(opts.status_path)!r}: not writable ({exc.strerror or exc})", file=sys.stderr)
        return USAGE_EXIT
    try:
        confined = confine_shard(opts)  # before any thread starts: they inherit it
    except OSError as exc:
        print(f"hsextract: {exc.strerror or exc}", file=sys.stderr)
        return USAGE_EXIT
    shard_log(opts.shard, opts.num_shards).info(confined.describe())
    heartbeat.progress.confined = confined.active
    heartbeat.progress.phase = "importing"
    heartbeat.start()  # the first heartbeat comes before torch is imported
    if opts.synthetic is not None:
        from hsextract.run.synthetic import run_synthetic  # no torch

        return run_synthetic(opts, heartbeat)
    from hsextract.run.readahead import start_read_ahead

    read_ahead = start_read_ahead(opts)  # the checkpoint into the page cache while torch and CUDA start
    hide_unused_packages()
    from hsextract.run.extract import run_shard  # imports torch

    return run_shard(opts, heartbeat, capture, read_ahead)


def export_command(args) -> int:
    """`hsextract export`: the summary on stdout (also in DEST/export.json); exit 2 naming what is wrong."""
    from hsextract.training.export import export

    try:
        summary = export(args.src, args.dest, args.format, args.max_length,
                         "full" if args.verify else not args.no_verify, allow_partial=args.allow_partial)
    except (ValueError, FileNotFoundError) as exc:  # CorruptOutput too: a file that is not what was written
        print(f"hsextract export: {exc}", file=sys.stderr)
        return USAGE_EXIT
    left = ", ".join(f"{n} {why}" for why, n in summary["skipped"].items()) or "none"
    if summary.get("partial"):
        print(f"PARTIAL export (--allow-partial): {summary['partial']}")
    print(f"exported {summary['exported']} of {summary['samples_in_src']} sample(s) to {args.dest} "
          f"({summary['format']}); left out: {left}\n"
          f"trainer layer ids: {summary['trainer_layer_ids']} ({summary['trainer_note']})\n"
          f"summary: {args.dest / 'export.json'}; every sample's row or reason: {args.dest / 'index.jsonl'}")
    return 0


def fsck_command(args) -> int:
    """`hsextract fsck`: every problem, one a line, then what was repaired; exit 0 clean, 1 problems (left), 2 the
    output cannot be read."""
    from hsextract.output.fsck import fsck

    try:
        found = fsck(args.out, repair=args.repair, verify=args.verify)
    except (OSError, ValueError) as exc:
        print(f"hsextract fsck: {args.out}: cannot read it: {exc}", file=sys.stderr)
        return USAGE_EXIT
    for problem in found["problems"]:
        print(f"PROBLEM {problem}")
    for done in found["repaired"]:
        print(f"REPAIRED {done}")
    left = found["remaining"] if args.repair else found["problems"]
    print(f"fsck {found['out']}: {found['shards']} shard journal(s), {found['files']} journaled file(s), "
          f"{len(found['recipes']) or 'no'} recipe(s): " + ("clean" if not found["problems"] else
          f"{len(found['problems'])} problem(s)" + (f", {len(left)} left" if args.repair else
                                                     " (--repair mends them)"))
          + ("; run reconcile (the flow) to seal it again" if args.repair and found["repaired"] else ""))
    return 1 if left else 0


def stage_command(args) -> int:
    """`hsextract stage`: prints `STAGE {json}`; exit 2 naming the file when a source is not what it should be,
    exit 1 when the store did not answer (after boto3's own retries)."""
    from hsextract.data import inputcache, sources

    if args.aws_credentials_file is not None:
        for name in KEY_ENV:
            os.environ.pop(name, None)
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(args.aws_credentials_file)
    out: dict | list[dict]  # prune's summary, else one entry per manifest
    try:
        manifests = [sources.Manifest.from_json(path.read_text(), str(path)) for path in args.manifest]
        cache = inputcache.Cache(args.cache)
        if not manifests and args.action != "prune":
            print(f"hsextract: stage {args.action} needs --manifest (one per source)", file=sys.stderr)
            return USAGE_EXIT
        if args.action == "prune":
            if not args.older_than_days >= 0:
                print(f"hsextract: --older-than-days {args.older_than_days}: expected 0 or more", file=sys.stderr)
                return USAGE_EXIT
            out = cache.prune(args.older_than_days * 86400, tuple(m.id for m in manifests if m.complete),
                              args.dry_run)
        elif args.action == "status":
            out = [{**cache.status(m), "offsets": cache.offsets(m)} for m in manifests]
        else:
            if args.action == "fetch":
                from hsextract.store import s3_client

                fetched = cache.fetch(s3_client(args.s3_endpoint), manifests, args.host, args.threads,
                                      args.part_mib << 20)
            elif args.follow:
                fetched = cache.follow(manifests, args.host, cache.root / "partial" / f"{args.follow}.abort")
            else:  # every file sent already
                fetched = cache.follow(manifests, args.host, stall_s=0)
            out = []
            for manifest, got in zip(manifests, fetched):
                complete = manifest.with_digests(got.digests)
                out.append({**vars(got), "view": str(cache.view(complete)), "id": complete.id})
    except (sources.StageError, OSError) as exc:
        print(f"hsextract: {exc}", file=sys.stderr)
        return USAGE_EXIT if getattr(exc, "retry", Retry.NEVER) is Retry.NEVER else 1  # exit 1: a retry may help
    finally:
        if args.aws_credentials_file is not None:
            args.aws_credentials_file.unlink(missing_ok=True)
    print("STAGE " + json.dumps(out), flush=True)
    return 0


def main(argv: list[str] | None = None, *, capture=None) -> int:
    """`hsextract` with `argv` (default: the process's); returns the exit code. `capture`: see `run_shard`."""
    args = build_parser().parse_args(argv)
    if args.command == "extract":
        return extract(WorkerOptions.from_args(args), capture)
    if args.command == "check":
        from hsextract.run.preflight import preflight

        opts = WorkerOptions.from_args(args)
        use_credentials_file(opts)
        try:
            if args.report:
                from hsextract.run.preflight import report

                print("CHECK " + json.dumps(report(opts, args.probe_output, args.sample_tokens)), flush=True)
            else:
                print("CHECK " + json.dumps(preflight(opts, args.probe_output, args.sample_tokens)), flush=True)
        except ValueError as exc:
            print(f"hsextract: {exc}", file=sys.stderr)
            return USAGE_EXIT
        finally:
            remove_credentials_file(opts)
        return 0
    if args.command == "export":
        return export_command(args)
    if args.command == "fsck":
        return fsck_command(args)
    if args.command == "stage":
        return stage_command(args)
    if args.command == "inspect":
        from hsextract.training.reader import describe_output

        print(json.dumps(describe_output(args.out, args.verify)))
        return 0
    from hsextract import tiny as tiny_assets

    if not (args.model / "config.json").exists():
        tiny_assets.build_model(args.model, kind="qwen3_5_text")
    if not args.data.exists():
        tiny_assets.build_dataset(args.data, args.samples)
    print(json.dumps({"model": str(args.model), "data": str(args.data)}))
    return 0


def run(argv: list[str] | None = None, *, capture=None) -> NoReturn:
    """The `hsextract` command (and `python -m hsextract`): `main`, then the process ends at once. When `main`
    returns, every subcommand has written, synced and closed what it leaves (a worker's exit.json last); what
    threads are left are daemons the interpreter would kill too. Its teardown of torch and transformers would only
    hold the process, and a worker's GPU memory, a second or more longer (0.9 s of CPU for the tiny model). An
    exception or a usage error leaves through the interpreter as usual."""
    code = main(argv, capture=capture)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
