"""The preflight flow against real hosts that differ the way machines of a fleet do: real sshd hosts in network
namespaces, one whose model directory is missing and one whose disk is nearly full (a mount namespace of their
own with a small tmpfs), one whose clock is 10 minutes off (libfaketime in its sessions), one whose host key is
not the one known; a real S3 endpoint (moto, with its credential checks on for the bad-credentials run), a real
Prefect server, the real worker's checks, and its real benchmark on the tiny model."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from flows.preflight import preflight
from harness.fleet import FAKETIME, add_hosts, place_model, s3_for
from harness.inventory import write_inventory
from harness.prefect import prefect_records
from harness.sshd import SshdFarm
from hsextract import tiny

@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model):
    """Hosts ok1, ok2, nomodel, full, skew, badkey (tests/harness/fleet.py); the model under models/."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root (mount namespaces)")
    base = tmp_path_factory.mktemp("preflight")
    model = place_model(tiny_model, base)
    with SshdFarm() as farm:
        entries = add_hosts(farm, base, model, {"ok1": None, "ok2": None, "nomodel": "nomodel", "full": "full",
                                                "skew": "skew", "badkey": "badkey"})
        data = tiny.build_dataset(base / "chat.jsonl", 2000, seed=7)
        with s3_for(farm, "ok1") as endpoint:
            yield dict(base=base, model=model, data=data, hosts=write_inventory(base / "hosts.yaml", entries),
                       faketime=Path(FAKETIME).exists(), s3=endpoint)


@pytest.fixture
def bucket(fleet, request):
    import boto3

    client = boto3.client("s3", endpoint_url=fleet["s3"], region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    name = "preflight-" + request.node.name[5:30].replace("_", "-").strip("-")
    client.create_bucket(Bucket=name)
    return client, name


def test_preflight_names_each_hosts_problem_and_plans_the_run(prefect_server, fleet, bucket):
    from prefect_aws import AwsCredentials

    client, bucket = bucket
    AwsCredentials(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1",
                   aws_client_parameters={"endpoint_url": fleet["s3"]}).save("preflight-s3", overwrite=True)
    state = preflight(model=str(fleet["model"]), data=str(fleet["data"]), output=f"s3://{bucket}/run",
                      hosts=str(fleet["hosts"]), layers="1,3", aws_credentials="preflight-s3", device="cpu",
                      benchmark=True, benchmark_samples=40, sample_tokens=300, return_state=True)
    assert state.is_failed()
    message = state.message
    result = state.result(raise_on_failure=False)
    hosts = result["hosts"]
    # the good hosts pass every check (no GPU here; the inputs are paths on the hosts: nothing to stage)
    for name in ("ok1", "ok2"):
        assert {c: s for c, s in hosts[name].items() if s != "ok"} == {"gpus": "skip", "inputs": "skip"}, hosts[name]
    # each injected problem, on its host, with its reason
    assert hosts["nomodel"]["model"] == "fail" and "host nomodel: model: --model" in message
    assert "no such directory" in message.split("host nomodel: model:")[1].split("\n")[0]
    assert hosts["full"]["disk"] == "fail" and "host full: disk:" in message
    assert "free on the workdir disk" in message.split("host full: disk:")[1].split("\n")[0]
    if fleet["faketime"]:
        assert hosts["skew"]["clock"] == "fail"
        assert "+600" in message.split("host skew: clock:")[1].split("\n")[0] or \
            "+599" in message.split("host skew: clock:")[1].split("\n")[0]
    assert hosts["badkey"]["ssh"] == "fail" and all(s == "skip" for c, s in hosts["badkey"].items() if c != "ssh")
    assert "host key" in message.split("host badkey: ssh:")[1].split("\n")[0].lower()
    # no other host fails anything
    assert {n for n, checks in hosts.items() if "fail" in checks.values()} == {"nomodel", "full", "skew", "badkey"} - (
        set() if fleet["faketime"] else {"skew"})
    # the plan: the dataset's samples, its tokens from the tokenizer, bytes, and the benchmark's rate
    plan = result["plan"]
    assert plan["samples"] == 2000 and not plan["exact"] and plan["sampled"] == 300
    assert plan["bytes_per_token"] == 2 * 64 * 4  # layers 1,3 of hidden 64 in float32 (CPU)
    assert plan["output_bytes"] == plan["tokens"] * plan["bytes_per_token"] and plan["tokens"] > 2000 * 20
    assert plan["tokens_per_s_per_gpu"] > 0 and plan["gpu_hours"] > 0 and plan["s3_requests_per_s"] > 0
    # the probe objects are gone
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="run/_preflight")
    # the credentials files too
    assert not list(fleet["base"].glob("w-*/preflight/credentials-*"))


def test_preflight_names_bad_credentials_and_a_missing_gpu_on_every_host(prefect_server, fleet, bucket):
    """moto checks credentials here (its IAM mode): keys it does not know are refused, as S3 refuses them."""
    from moto import settings
    from prefect_aws import AwsCredentials

    client, bucket = bucket
    secret = f"hsx-secret-{uuid.uuid4().hex}"
    AwsCredentials(aws_access_key_id="AKIAWRONGWRONGWRONG0", aws_secret_access_key=secret, region_name="us-east-1",
                   aws_client_parameters={"endpoint_url": fleet["s3"]}).save("preflight-bad", overwrite=True)
    import yaml

    hosts = write_inventory(fleet["base"] / "two.yaml", yaml.safe_load(Path(fleet["hosts"]).read_text())["hosts"][:2])
    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    try:
        state = preflight(model=str(fleet["model"]), data=str(fleet["data"]), output=f"s3://{bucket}/run",
                          hosts=str(hosts), layers="1,3", aws_credentials="preflight-bad", device="cuda",
                          return_state=True)
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
    assert state.is_failed()
    for name in ("ok1", "ok2"):
        line = state.message.split(f"host {name}: output:")[1].split("\n")[0]
        assert "cannot write a probe object" in line and ("InvalidAccessKeyId" in line or "403" in line), line
        line = state.message.split(f"host {name}: gpus:")[1].split("\n")[0]
        assert "no CUDA device" in line and "device is cuda" in line, line
    # the keys went to each host as a 0600 file the check read and removed: never in Prefect's records or on disk
    assert secret not in prefect_records(state.state_details.flow_run_id)
    leaked = [p for p in fleet["base"].rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_the_worker_check_reports_every_problem_at_once(tiny_model, tmp_path):
    """`hsextract check --report`: each check's verdict on its own (a missing model hides neither the dataset's
    nor the output's)."""
    import json
    import sys

    out = subprocess.run([sys.executable, "-m", "hsextract", "check", "--model", str(tmp_path / "none"), "--data",
                          str(tmp_path / "none.jsonl"), "--out", "/proc/forbidden/out", "--layers", "1", "--shard", "0",
                          "--num-shards", "1", "--report", "--probe-output"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    verdicts = json.loads(out.stdout.split("CHECK ", 1)[1])
    assert "no such directory" in verdicts["model"]["error"]
    assert "no such file" in verdicts["dataset"]["error"]
    assert "/proc/forbidden/out" in verdicts["output"]["error"]


def test_extract_with_preflight_only_checks_and_launches_nothing(prefect_server, fleet, tmp_path):
    """`extract(preflight="only")` (the deployment `extract/qwen-preflight`): the preflight's verdict and plan
    artifacts, no worker launched; `preflight="first"` with a host that would fail stops before any launch."""
    import yaml
    from prefect.client.orchestration import get_client

    from flows.extract import extract

    entries = yaml.safe_load(Path(fleet["hosts"]).read_text())["hosts"]
    good = write_inventory(tmp_path / "good.yaml", entries[:2])
    common = dict(model=str(fleet["model"]), data=str(fleet["data"]), output=f"file://{tmp_path}/out",
                  layers="1,3", device="cpu", return_state=True)
    state = extract(hosts=str(good), preflight="only", run_name="pre-only", **common)
    assert state.is_completed() and "2 host(s) ready" in state.message, state.message
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:  # filtered: an unfiltered read returns one page only
        keys = {a.key for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["preflight-pre-only", "plan-pre-only"])))}
    assert {"preflight-pre-only", "plan-pre-only"} <= keys
    assert not list(fleet["base"].glob("w-*/runs/pre-only"))  # nothing launched
    bad = write_inventory(tmp_path / "bad.yaml", entries[:3])  # + nomodel
    state = extract(hosts=str(bad), preflight="first", run_name="pre-first", **common)
    assert state.is_failed() and "host nomodel: model:" in state.message, state.message
    assert not list(fleet["base"].glob("w-*/runs/pre-first"))
