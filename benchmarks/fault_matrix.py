"""The fault and abuse matrix: every injected fault against the real system, and how each one ended.

    .venv/bin/python benchmarks/fault_matrix.py [--fast] [--only NAME[,NAME...]] [--markdown FILE]

Real sshd hosts (two in network namespaces, one on loopback), a real S3 endpoint (moto) behind a fault proxy,
a real Prefect server (and for the orchestrator rows a `prefect server start` + `prefect worker start` of their
own), the tiny Qwen3.5 model. Each row injects one fault into a run of the `extract` flow,
then takes the re-run path (the same flow, same run name, fault removed) and audits what landed:

  fault           what was done to the run
  expected        the end state the product promises (Completed, or Failed with the reason named)
  observed        the end state of the faulted run, and the reason it gave (its first words)
  detect s        fault injected -> the run (or its shard's task) said so; for launch faults, from flow start
  lost / dup      dataset samples that are neither stored nor skipped with a reason / stored more than once,
                  after the re-run path (the reader, verifying checksums, against the dataset)
  left            flow runs and task runs left Pending or Running by the row
  re-run          the end state of the re-run path

A row passes when observed matches expected (and the reason holds the expected words), the re-run path
completes (where a run had something to re-run), lost == dup == left == 0. `--fast` is the subset CI runs
(tests/integration/test_fault_matrix.py). The process exits 1 if any row fails.

The rows live in benchmarks/faults/: hostrows (deploy, launch, run), storagerows, datarows, orchestrator
(a served Prefect server, deployment and worker), abuse (injection, object keys, confinement, modes, secrets).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import abuse, datarows, hostrows, orchestrator, storagerows  # noqa: E402
from faults.lab import Lab, Row, dataset_ids, print_notes, print_table, run_rows  # noqa: E402

from hsextract import tiny  # noqa: E402

H, S, D, O, A = hostrows, storagerows, datarows, orchestrator, abuse
ROWS = [
    Row("baseline", "clean", "no fault: two hosts, two shards", "Completed", (), H.clean_run),
    Row("deploy", "put_fails", "workdir's parent is a file: the bundle put fails", "Failed",
        ("host h1", "not-a-dir"), H.deploy_put_fails),
    Row("deploy", "disk_full", "workdir on a 64 KiB tmpfs", "Failed", ("host lo", "KiB free on the disk"),
        H.deploy_disk_full),
    Row("deploy", "wrong_bundle", "the bundle arrives altered: wrong hash", "Failed",
        ("wrong bundle hash", "HASH MISMATCH", "nothing unpacked"), H.wrong_bundle),
    Row("deploy", "unknown_host_key", "the host's key is not in known_hosts", "Failed",
        ("host h1", "not found in known_hosts", "nothing deployed"), H.host_key("unknown")),
    Row("deploy", "changed_host_key", "the host's key changed (known_hosts holds another)", "Failed",
        ("host h1", "BadHostKeyException", "nothing deployed"), H.host_key("changed")),
    Row("launch", "no_output", "the worker prints nothing and never exits", "Failed",
        ("shard 0/1 on h1", "STARTED"), H.launch_fault("sleep 3600")),
    Row("launch", "exit_0", "the worker exits 0 at once, printing nothing", "Failed",
        ("shard 0/1 on h1", "exited at once"), H.launch_fault("exit 0"), fast=True),
    Row("launch", "no_interpreter", "the inventory's python does not exist", "Failed",
        ("host h1", "/nonexistent/python3"), H.launch_fault(python="/nonexistent/python3")),
    Row("launch", "import_error", "the worker dies on an ImportError", "Failed",
        ("shard 0/1 on h1", "ModuleNotFoundError"),
        H.launch_fault(f"exec {sys.executable} -c 'import hsx_missing_dependency'")),
    Row("launch", "log_unwritable", "worker.log cannot be created", "Failed",
        ("shard 0/1 on h1", "cannot create the worker log"), H.launch_fault(before=H.log_dir_unwritable)),
    Row("launch", "duplicate", "the same run launched twice at once", "Completed", (), H.duplicate_launch),
    Row("run", "kill9", "kill -9 of the worker mid-run", "Failed", ("shard 0/1 on h1", "lost"),
        H.signal_mid_run(signal.SIGKILL), fast=True),
    Row("run", "sigstop", "SIGSTOP of the worker mid-run", "Failed", ("shard 0/1 on h1", "stalled"),
        H.signal_mid_run(signal.SIGSTOP)),
    Row("run", "oom_kill", "the kernel OOM-kills the worker (memory cgroup)", "Failed",
        ("shard 0/1 on lo", "lost", "kernel oom_kill count 1"), H.oom_kill),
    Row("run", "hung", "the forward loop hangs, the heartbeat goes on", "Failed",
        ("shard 0/1 on h1", "stalled: no progress"), H.hung),
    Row("run", "cut_short", "host cut off for 2 s (host_timeout_s 5)", "Completed", (), H.cut_host(2)),
    Row("run", "cut_long", "host cut off for 20 s (host_timeout_s 5); re-run elsewhere", "Failed",
        ("shard 0/2 on h1", "host unreachable"), H.cut_host(20)),
    Row("run", "reboot", "host reboot: processes gone, sshd down 2 s, files kept", "Failed",
        ("shard 0/1 on h1",), H.reboot),
    Row("run", "out_disk_full", "the output disk fills up mid-run (3 MiB tmpfs), then grows", "Failed",
        ("shard 0/1 on lo", "No space left on device"), H.out_disk_full),
    Row("storage", "s3_5xx_burst", "six 503/500 answers to batch PUTs", "Completed", (), S.storage_fault(S.burst())),
    Row("storage", "s3_revoked", "credentials revoked (403) after 3 batch PUTs", "Failed", ("AccessDenied",),
        S.storage_fault(S.revoke_after(3)), fast=True),
    Row("storage", "s3_no_bucket", "the output bucket does not exist", "Failed",
        ("NoSuchBucket", "before any launch"),
        S.storage_fault(output_for=lambda store: "s3://hsx-no-such-bucket/run")),
    Row("storage", "s3_object_deleted", "a stored batch object deleted after the run", "Failed",
        ("missing",), S.object_deleted),
    Row("storage", "corrupt_spooled", "a spooled batch file altered before its upload", "Failed",
        ("sha256",), S.storage_fault(bandwidth=200_000, strike=S.corrupt_spooled)),
    Row("storage", "spool_high_water", "upload slower than extraction: spool at its 512 KiB high-water mark",
        "Completed", ("held", "paused"), S.spool_high_water),
    Row("orchestrator", "flow_killed", "the flow-run process killed -9 mid-run (worker alive)", "Crashed",
        ("status code: -9", "adopted the same worker pids"), O.flow_process_killed),
    Row("orchestrator", "worker_killed", "the Prefect worker killed -9 mid-run", "Completed", (), O.worker_killed),
    Row("orchestrator", "orchestrator_killed", "worker and flow-run process killed -9 at once", "Crashed",
        ("no heartbeat", "adopted the same worker pids"), O.orchestrator_killed),
    Row("orchestrator", "server_restart", "`prefect server` stopped and started again mid-run", "Completed", (),
        O.server_restarted),
    Row("data", "bad_lines", "malformed, empty, assistant-less, over-long lines and a repeated id", "Completed",
        ("2 skipped with a reason",), D.bad_lines, fast=True),
    Row("data", "missing_weights", "the model dir lacks a weights file", "Failed", ("safetensors",),
        D.bad_input(D.model_missing_shard)),
    Row("data", "layer_out_of_range", "layers=1,99 on an 8-layer model", "Failed", ("99",),
        D.bad_input(lambda case: {"layers": "1,99"}), fast=True),
    Row("abuse", "injection", "hypothesis values with shell payloads in every field of every remote command",
        "Completed", ("canary never written",), A.injection, fast=True),
    Row("abuse", "key_escape", "output prefix with '..'; a journal in the store naming ../../x", "Failed",
        ("not a plain file name", "refused before any launch"), A.key_escape),
    Row("abuse", "shard_confined", "shard 0's worker writes into shard 1's dirs", "Completed",
        ("6 of 6 refused", "Landlock"), A.shard_confined, fast=True),
    Row("abuse", "file_modes", "modes of everything the rows left on hosts and outputs", "Completed",
        ("none open to others",), A.file_modes, rerun_needed=False),
    Row("abuse", "secrets_at_rest", "keys of every storage row in files, Prefect records, reports, argv, env",
        "Completed", ("(watched)",), A.secrets_at_rest, rerun_needed=False),  # last: it searches what the rows left
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fast", action="store_true", help="only the rows CI runs")
    ap.add_argument("--only", help="comma-separated row names")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    rows = [r for r in ROWS if (not args.fast or r.fast) and (not args.only or r.name in args.only.split(","))]
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # here, not at import: the tests import this
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from moto.server import ThreadedMotoServer
    from prefect.testing.utilities import prefect_test_harness

    from sshhosts import SshdFarm

    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    work = Path(tempfile.mkdtemp(prefix="hsx-faults-"))
    model = tiny.build_model(work / "model", kind="qwen3_5_text")
    data = tiny.build_dataset(work / "chat.jsonl", 48, seed=7)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    began = time.monotonic()
    lab = None
    try:
        with SshdFarm() as farm, prefect_test_harness(server_startup_timeout=120):
            for name, netns in (("h1", True), ("h2", True), ("lo", False)):
                farm.add_host(name, netns=netns)
            host, port = moto.get_host_and_port()
            lab = Lab(work, farm, f"http://{host}:{port}", model, data)
            lab.watch_processes()
            results = run_rows(lab, rows, progress=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        if lab is not None:
            lab.close()
        moto.stop()
    print(f"\nfault matrix: {len(results)} rows in {time.monotonic() - began:.0f}s, {os.cpu_count()} CPU cores, "
          f"hosts: sshd in network namespaces (h1, h2) and on loopback, {len(dataset_ids(data))} samples a short run, "
          f"{len(dataset_ids(lab.long_data))} a long one (rows that strike mid-run)\n")
    print_table(results)
    print_notes(results, lab.seconds)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            print_table(results, handle)
            print("", file=handle)
            print_notes(results, lab.seconds, handle)
    return 0 if all(row.passed(o) for row, o in results) else 1


if __name__ == "__main__":
    sys.exit(main())
