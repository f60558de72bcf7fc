"""The fault and abuse matrix: every injected fault against the real system, and how each one ended.

    .venv/bin/python benchmarks/fault_matrix.py [--fast] [--group GROUP] [--only NAME[,NAME...]] [--markdown FILE]

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

The rows live in tests/harness/faults/ (the test harness): hostrows (deploy, launch, run), storagerows, datarows,
orchestrator (a served Prefect server, deployment and worker), cancelrows (each cancel path, and a cancel at each
point of a run), abuse (injection, object keys, confinement, modes, secrets).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from harness.faults import ROWS
from harness.faults.lab import Lab, dataset_ids, print_notes, print_table, run_rows
from hsextract import tiny


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fast", action="store_true", help="only the rows CI runs")
    ap.add_argument("--group", help="only the rows of this group (deploy, launch, run, storage, orchestrator, "
                                    "cancel, data, abuse)")
    ap.add_argument("--only", help="comma-separated row names")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    rows = [r for r in ROWS if (not args.fast or r.fast) and (not args.only or r.name in args.only.split(","))
            and (not args.group or r.group == args.group)]
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # here, not at import: the tests import this
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from prefect.testing.utilities import prefect_test_harness

    from harness.moto_s3 import start_server
    from harness.sshd import SshdFarm

    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    work = Path(tempfile.mkdtemp(prefix="hsx-faults-"))
    model = tiny.build_model(work / "model", kind="qwen3_5_text")
    data = tiny.build_dataset(work / "chat.jsonl", 48, seed=7)
    moto = start_server()  # conditional writes atomic, as S3's are
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
