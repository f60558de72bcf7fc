"""The `extract` flow with output=s3:// on a real Prefect server, a real sshd host and a real S3 endpoint.

Credentials come from a prefect-aws AwsCredentials block (endpoint_url in its client parameters) and must
reach the host only as a 0600 file that is gone when the shard ends: never in argv, logs, artifacts,
task states or any other file (grepped for, while the run goes on and after it).
"""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from collections import Counter
from pathlib import Path

import pytest

import hsextract
from flows.extract import extract
from hsextract import tiny
from tasks.reconcile import INDEX_NAME, SUCCESS_NAME

from harness.worker import dataset_ids
from harness.inventory import ssh_host_entry, write_inventory
from harness.prefect import prefect_records

FAST = dict(heartbeat_interval_s=0.5, poll_interval_s=0.3, launch_timeout_s=30, stall_timeout_s=20,
            host_timeout_s=10)


class Watch:
    """While a run goes on: every command line on the machine, and the mode of each credentials file."""

    def __init__(self, secrets: list[str], workdir: Path):
        self.secrets, self.workdir = secrets, workdir
        self.argv_hits: list[str] = []
        self.modes: set[int] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
            self.argv_hits += [line for line in ps.splitlines() if any(s in line for s in self.secrets)]
            for path in self.workdir.glob("runs/*/*/aws-credentials"):
                try:
                    self.modes.add(path.stat().st_mode & 0o777)
                except FileNotFoundError:
                    pass
            self.stop.wait(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def grep_tree(root: Path, secrets: list[str]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits += [f"{path}: {s[:4]}..." for s in secrets if s.encode() in data]
    return hits



@pytest.fixture
def aws_block(s3_endpoint, prefect_server):
    from prefect_aws import AwsCredentials

    key_id, secret = f"AKIAHSX{uuid.uuid4().hex[:13].upper()}", f"hsx-secret-{uuid.uuid4().hex}"
    AwsCredentials(aws_access_key_id=key_id, aws_secret_access_key=secret, region_name="us-east-1",
                   aws_client_parameters={"endpoint_url": s3_endpoint}).save("test-s3", overwrite=True)
    return "test-s3", [key_id, secret]


def test_s3_run_seals_streams_back_and_never_leaks_the_keys(farm, tiny_model, s3, aws_block, tmp_path):
    client, bucket = s3
    name, secrets = aws_block
    data = tiny.build_dataset(tmp_path / "chat.jsonl", 120, seed=4)
    workdir = tmp_path / "w"
    hosts = write_inventory(tmp_path / "hosts.yaml", [ssh_host_entry(farm.host("lo"), workdir)])
    output = f"s3://{bucket}/runs/qwen"
    kwargs = dict(model=str(tiny_model), data=str(data), output=output, hosts=str(hosts), layers="1,3",
                  token_budget=512, run_name="s3run", aws_credentials=name, upload_from="memory", **FAST)
    with Watch(secrets, workdir) as watch:
        state = extract(return_state=True, **kwargs)
    assert state.is_completed(), state.message
    rec = state.result()["reconcile"]
    assert rec["complete"] and rec["sealed"] and rec["done"] == 120
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/qwen/")["Contents"]}
    assert {f"runs/qwen/{SUCCESS_NAME}", f"runs/qwen/{INDEX_NAME}"} <= keys
    assert not list(workdir.rglob("*.safetensors")), "every local copy freed after its verification"
    mirrored = [json.loads(l) for shard in (0, 1) for l in client.get_object(
        Bucket=bucket, Key=f"runs/qwen/shard-{shard:05d}-of-00002/journal.jsonl")["Body"].read().decode().splitlines()]
    files = [e for e in mirrored if e["kind"] == "file"]
    assert files and all(e["from_memory"] for e in files), "upload_from='memory' reached the workers"

    # the reader streams the same dataset back from the bucket, each sample exactly once
    ids = Counter(s["id"] for s in hsextract.read_samples(output, verify=True, client=client))
    assert ids == Counter(dataset_ids(data))

    # the keys reached the host only as a 0600 file, now removed; nowhere else, ever
    assert watch.modes == {0o600}, f"credentials file modes seen: {watch.modes}"
    assert not list(workdir.rglob("aws-credentials")), "credentials file left on the host"
    assert watch.argv_hits == []
    assert grep_tree(workdir, secrets) == [] and grep_tree(tmp_path, secrets) == []
    text = prefect_records(state.state_details.flow_run_id)
    assert "s3run" in text and "reconcile" in text  # the records were really read
    assert not [s for s in secrets if s in text]


def test_s3_object_deleted_is_reported_then_restored_by_the_rerun(farm, tiny_model, s3, aws_block, tmp_path):
    client, bucket = s3
    name, _ = aws_block
    data = tiny.build_dataset(tmp_path / "chat.jsonl", 80, seed=5)
    hosts = write_inventory(tmp_path / "hosts.yaml", [ssh_host_entry(farm.host("lo"), tmp_path / "w")])
    output = f"s3://{bucket}/r"
    kwargs = dict(model=str(tiny_model), data=str(data), output=output, hosts=str(hosts), layers="1,3",
                  token_budget=512, run_name="s3redo", aws_credentials=name, **FAST)
    assert extract(return_state=True, **kwargs).is_completed()
    client.delete_object(Bucket=bucket, Key=f"r/{SUCCESS_NAME}")
    journal = client.get_object(Bucket=bucket, Key="r/shard-00001-of-00002/journal.jsonl")["Body"].read()
    lost = next(json.loads(l) for l in journal.decode().splitlines() if '"kind":"file"' in l)
    client.delete_object(Bucket=bucket, Key=f"r/shard-00001-of-00002/{lost['file']}")

    state = extract(return_state=True, **kwargs)
    assert state.is_failed()
    message = str(pytest.raises(Exception, state.result).value)
    assert f"reconcile found {len(lost['ids'])} sample(s) missing" in message
    assert "re-run of shard(s) [1] requested" in message

    state = extract(return_state=True, **kwargs)
    assert state.is_completed(), state.message
    rec = state.result()["reconcile"]
    assert rec["complete"] and rec["sealed"] and rec["duplicated"] == 0 and rec["done"] == 80
    ids = Counter(s["id"] for s in hsextract.read_samples(output, client=client))
    assert ids == Counter(dataset_ids(data))


def test_missing_credentials_block_fails_before_any_launch(prefect_server, tmp_path):
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0],
                                                       "workdir": str(tmp_path / "w"), "python": "python3"}])
    state = extract(return_state=True, model="m", data="d", output="s3://bucket/x", hosts=str(hosts),
                    aws_credentials="no-such-block", **FAST)
    assert state.is_failed()
    message = str(pytest.raises(Exception, state.result).value)
    assert "aws_credentials='no-such-block'" in message and "no AwsCredentials or S3Bucket block" in message
    assert not (tmp_path / "w").exists(), "nothing was deployed"


def test_upload_from_memory_with_a_local_output_fails_before_any_launch(prefect_server, tmp_path):
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0],
                                                       "workdir": str(tmp_path / "w"), "python": "python3"}])
    state = extract(return_state=True, model="m", data="d", output=str(tmp_path / "out"), hosts=str(hosts),
                    upload_from="memory", **FAST)
    assert state.is_failed()
    message = str(pytest.raises(Exception, state.result).value)
    assert "upload_from='memory' needs an s3:// output" in message and str(tmp_path / "out") in message
    assert not (tmp_path / "w").exists(), "nothing was deployed"
