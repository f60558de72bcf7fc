"""The preflight on a fleet: time to the table, and every injected problem named on its host.

    .venv/bin/python benchmarks/preflight_scale.py [--hosts 32] [--samples 20000]

Real sshd hosts in network namespaces (tests/harness/fleet.py), one of them with each problem: the model
directory missing, the disk nearly full, the clock 10 minutes off, a host key that is not the one known. A real
S3 endpoint (moto), a real Prefect server, the real `preflight` flow (tasks/preflight.py) with the tiny model.
Three runs: a first one (the bundle pushed, each host's imports checked), the timed one, then one with bad S3
credentials and device=cuda on this machine without a GPU (every host must say both). Prints the time from
the flow's start to its table, and for each injected problem the host and reason the preflight gave.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from harness.fleet import add_hosts, place_model, s3_for
from harness.inventory import write_inventory
from harness.sshd import SshdFarm

from flows.preflight import preflight

#: what the preflight must say, per injected problem: (check, words in its reason)
EXPECT = {"nomodel": ("model", "no such directory"), "full": ("disk", "free on the workdir disk"),
          "skew": ("clock", "against the orchestrator's"), "badkey": ("ssh", "does not match"),
          "credentials": ("output", "InvalidAccessKeyId"), "cuda": ("gpus", "no CUDA device")}


def reason(state, host: str, check: str) -> str:
    return state.result(raise_on_failure=False).get("problems", {}).get(host, {}).get(check, "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=20000)
    args = ap.parse_args()
    import boto3
    from moto import settings
    from prefect.testing.utilities import prefect_test_harness
    from prefect_aws import AwsCredentials

    work = Path(tempfile.mkdtemp(prefix="hsx-preflight-"))
    built, data = work / "built", work / "data.jsonl"
    subprocess.run([sys.executable, "-m", "hsextract", "make-tiny", "--model", str(built), "--data", str(data),
                    "--samples", str(args.samples)], check=True, capture_output=True)
    model = place_model(built, work)
    problems = {f"p{i:02d}": None for i in range(args.hosts)}
    injected = dict(zip(list(problems)[1:5], ("nomodel", "full", "skew", "badkey")))
    problems.update(injected)
    ok = True
    with SshdFarm() as farm, prefect_test_harness(server_startup_timeout=120):
        entries = add_hosts(farm, work, model, problems)
        hosts = write_inventory(work / "fleet.yaml", entries)
        with s3_for(farm, "p00") as endpoint:
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="k",
                         aws_secret_access_key="s").create_bucket(Bucket="fleet")
            for name, key in (("good", "testing"), ("bad", "AKIAWRONGWRONGWRONG0")):
                AwsCredentials(aws_access_key_id=key, aws_secret_access_key="testing", region_name="us-east-1",
                               aws_client_parameters={"endpoint_url": endpoint}).save(f"pf-{name}", overwrite=True)
            common = dict(model=str(model), data=str(data), output="s3://fleet/run", hosts=str(hosts), layers="1,3",
                          return_state=True)
            began = time.monotonic()
            preflight(aws_credentials="pf-good", device="cpu", **common)
            first = time.monotonic() - began
            began = time.monotonic()
            state = preflight(aws_credentials="pf-good", device="cpu", **common)
            timed = time.monotonic() - began
            result = state.result(raise_on_failure=False)
            before = settings.INITIAL_NO_AUTH_ACTION_COUNT
            settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # moto checks the keys now, as S3 does
            try:
                began = time.monotonic()
                bad = preflight(aws_credentials="pf-bad", device="cuda", **common)
                third = time.monotonic() - began
            finally:
                settings.INITIAL_NO_AUTH_ACTION_COUNT = before
    print(f"\npreflight of {args.hosts} sshd hosts (network namespaces), tiny model, {args.samples} samples, "
          f"S3 output (moto), {os.cpu_count()} CPU cores")
    print(f"{'run':<70}{'s':>8}  goal")
    print(f"{'first (bundle pushed, imports checked on every host)':<70}{first:>8.1f}")
    print(f"{'again: flow start -> table':<70}{timed:>8.1f}  < 30")
    print(f"{'bad credentials and device=cuda (no GPU here)':<70}{third:>8.1f}")
    print(f"\n{'injected problem':<18}{'host':<8}{'check':<8}{'named':<7}reason given")
    for host, problem in injected.items():
        check, words = EXPECT[problem]
        said = reason(state, host, check)
        good = words in said and result["hosts"][host][check] == "fail"
        ok &= good
        print(f"{problem:<18}{host:<8}{check:<8}{'yes' if good else 'NO':<7}{said[:110]}")
    others = [h for h, checks in result["hosts"].items() if h not in injected and "fail" in checks.values()]
    ok &= not others
    print(f"{'(none)':<18}{'others':<8}{'':<8}{'yes' if not others else 'NO':<7}"
          f"{len(result['hosts']) - len(injected) - len(others)} other hosts pass" +
          (f"; failing: {others}" if others else ""))
    for problem in ("credentials", "cuda"):
        check, words = EXPECT[problem]
        named = [h for h in problems if h not in injected and words in reason(bad, h, check)]
        ok &= len(named) == len(problems) - len(injected)
        print(f"{problem:<18}{'all':<8}{check:<8}{f'{len(named)}/{len(problems) - len(injected)}':<7}"
              f"{reason(bad, 'p00', check)[:110]}")
    plan = result["plan"]
    print(f"\nplan: {plan.get('samples')} samples, ~{plan.get('tokens')} tokens, "
          f"{plan.get('output_bytes', 0) / 2**20:.1f} MiB of output, {plan.get('files')} files")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
