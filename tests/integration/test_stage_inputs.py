"""Staging a run's inputs onto real sshd hosts (tasks/stage.py, hsextract/data/sources.py): from a real S3 endpoint
(moto, reached from each host's network namespace) and from the orchestrator over SFTP; every file verified by
size and sha256; nothing sent twice; a partial file resumed; and each kind of bad input named before a byte is
sent or any GPU work, with a corrected re-run picking up where staging stopped."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.fleet import s3_for
from harness.inventory import ssh_host_entry, write_inventory
from hsextract import tiny
from hsextract.errors import Retry
from hsextract.data.inputcache import Cache
from hsextract.data.records import iter_ids
from hsextract.data.sources import Manifest, local_manifest, manifest_uri
from tasks.bundle import build_bundle
from tasks.credentials import S3Access
from tasks.deploy import deploy_host
from tasks.hosts import connect
from tasks.inventory import parse_inventory
from tasks.stage import (
    StageFailed,
    cache_dir,
    dataset_here,
    resolve_source,
    resolve_sources,
    settle_manifests,
    stage_host,
)

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "stage-inputs"


class Log:
    def __init__(self):
        self.lines = []

    def info(self, msg, *args):
        self.lines.append(msg % args)

    warning = info


def to_parquet(jsonl: Path, path: Path) -> Path:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def upload_dir(client, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local).as_posix()}")


@pytest.fixture(scope="module")
def env(farm, tmp_path_factory, tiny_model):
    """Hosts h1 (own network namespace) and lo, plus `small` whose input cache is a 64 KiB tmpfs; the bundle
    deployed on each; moto with the tiny model and a Parquet dataset under s3://stage-inputs/."""
    import boto3

    base = tmp_path_factory.mktemp("stage")
    farm.add_host("small", netns=True, mounts={str(base / "w-small" / "inputs"): 64 << 10})
    entries = [ssh_host_entry(farm.host(n), base / f"w-{n}") for n in ("h1", "lo", "small")]
    inventory = parse_inventory(write_inventory(base / "hosts.yaml", entries).read_text())
    bundle = build_bundle(ROOT)
    for spec in inventory.hosts:
        with connect(spec, inventory) as host:
            deploy_host(host, bundle, "0.1.0")
    data = to_parquet(tiny.build_dataset(base / "chat.jsonl", 60, seed=7), base / "chat.parquet")
    with s3_for(farm, "h1") as url:
        access = S3Access(endpoint_url=url, region="us-east-1", access_key_id="testing",
                          secret_access_key="testing")
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
        client.create_bucket(Bucket=BUCKET)
        upload_dir(client, tiny_model, "models/tiny")
        client.upload_file(str(data), BUCKET, "data/chat.parquet")
        yield dict(base=base, inventory=inventory, bundle=bundle, access=access, client=client, data=data,
                   model=tiny_model)


def stage_on(env, name: str, sources: dict, log=None):
    with connect(env["inventory"].host(name), env["inventory"]) as host:
        return stage_host(host, sources, env["bundle"].sha256, env["access"], log)


def same_tree(a: Path, b: Path) -> bool:
    files = lambda root: {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")  # noqa: E731
                          if p.is_file() and not p.name.endswith(".hsextract-manifest.json")}
    return files(a) == files(b)


def test_s3_sources_are_staged_verified_and_never_sent_twice(env, monkeypatch):
    params = {"model": f"s3://{BUCKET}/models/tiny/", "data": f"s3://{BUCKET}/data/chat.parquet"}
    sources = resolve_sources(params["model"], params["data"], env["access"])
    assert not sources["model"].manifest.complete, "no manifest yet: the first staging computes the digests"
    log = Log()
    staged = {name: stage_on(env, name, sources, log) for name in ("h1", "lo")}
    for name, got in staged.items():
        assert Path(got.paths["data"]).read_bytes() == env["data"].read_bytes()
        assert same_tree(Path(got.paths["model"]), env["model"])
        assert got.sent_bytes == sum(s.manifest.size for s in sources.values())
        cache = Path(cache_dir(str(env["base"] / f"w-{name}")))
        assert not list((cache / "manifests").glob("credentials-*")), "the keys' file is removed"
        assert not list((cache / "partial").iterdir()), "every partial file became a blob"
        assert all(oct(p.stat().st_mode & 0o777) == "0o440" for p in (cache / "blobs").rglob("*") if p.is_file())
    assert "1 file(s) already there" not in "\n".join(log.lines)

    # the hosts agreed on every digest: the manifest is written next to each source, and matches the bytes
    settled, odd = settle_manifests(sources, staged, env["access"], Log())
    assert odd == {}
    kept = Manifest.from_json(env["client"].get_object(Bucket=BUCKET, Key="models/tiny.hsextract-manifest.json")
                              ["Body"].read().decode())
    assert kept.complete and {e.path: e.sha256 for e in kept.files} == {
        p.relative_to(env["model"]).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in env["model"].rglob("*") if p.is_file()}

    # a second staging (the manifest now read from S3): nothing is sent, the views are the same
    again = resolve_sources(params["model"], params["data"], env["access"])
    assert again["model"].manifest.complete
    for name in ("h1", "lo"):
        second = stage_on(env, name, again)
        assert second.sent_bytes == 0 and second.resumed_bytes == 0
        assert second.kept_files == sum(len(s.manifest.files) for s in again.values())
        assert second.paths == staged[name].paths

    # reconcile's copy on the orchestrator: the same file, verified against the same manifest
    monkeypatch.setenv("HSEXTRACT_CACHE", str(env["base"] / "orchestrator-cache"))
    here = dataset_here(params["data"], again, env["access"])
    assert here.startswith(str(env["base"] / "orchestrator-cache"))
    assert list(iter_ids(here)) == list(iter_ids(env["data"]))


@pytest.mark.parametrize("sender", ["openssh", "paramiko"])
def test_an_orchestrator_source_resumes_a_partial_file(env, tmp_path, monkeypatch, sender):
    """Sent with OpenSSH's `sftp` where the orchestrator has it, else with paramiko's SFTP (the fallback)."""
    if sender == "paramiko":
        which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda cmd, *a, **kw: None if cmd == "sftp" else which(cmd, *a, **kw))
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "x", "sent_by": sender}))  # not a blob yet
    blob = os.urandom(3 << 20)
    (src / "weights.safetensors").write_bytes(blob)
    source = resolve_source("model", f"orchestrator:{src}", env["access"])
    assert source.manifest.complete and (tmp_path / "ckpt.hsextract-manifest.json").is_file()
    assert local_manifest(src) == local_manifest(src), "kept next to the source and reused"
    # a send cut short: the first MiB already in the host's partial file
    cache = Cache(cache_dir(str(env["base"] / "w-h1")))
    entry = next(e for e in source.manifest.files if e.path == "weights.safetensors")
    part = cache.partial(entry, source.manifest.source)
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(blob[:1 << 20])
    got = stage_on(env, "h1", {"model": source})
    assert got.resumed_bytes == 1 << 20 and got.sent_bytes == (2 << 20) + len((src / "config.json").read_bytes())
    assert (Path(got.paths["model"]) / "weights.safetensors").read_bytes() == blob
    assert stage_on(env, "h1", {"model": source}).sent_bytes == 0


def test_a_wrong_manifest_is_named_and_a_corrected_rerun_resumes(env):
    client = env["client"]
    client.put_object(Bucket=BUCKET, Key="bad/config.json", Body=b'{"model_type": "qwen3_5_text"}')
    client.put_object(Bucket=BUCKET, Key="bad/model.safetensors", Body=os.urandom(1 << 20))
    uri = f"s3://{BUCKET}/bad/"
    first = resolve_source("model", uri, env["access"])
    truth = stage_on(env, "lo", {"model": first}).digests["model"]
    # the manifest says another digest for the weights than the object has (a stale or corrupt manifest)
    wrong = first.manifest.with_digests({**truth, "model.safetensors": "0" * 64})
    wrong = Manifest(wrong.source, wrong.kind, tuple(
        e if e.path != "model.safetensors" else type(e)(e.path, e.size, "0" * 64, e.etag) for e in wrong.files))
    client.put_object(Bucket=BUCKET, Key="bad.hsextract-manifest.json", Body=wrong.to_json().encode())
    source = resolve_source("model", uri, env["access"])
    with pytest.raises(StageFailed) as err:
        stage_on(env, "h1", {"model": source})
    text = str(err.value)
    assert err.value.retry is Retry.NEVER and "host h1" in text and "model.safetensors" in text
    assert "does not match its manifest" in text and manifest_uri(uri) in text
    # corrected: the right manifest; what was staged before (config.json) is not sent again
    client.put_object(Bucket=BUCKET, Key="bad.hsextract-manifest.json",
                      Body=first.manifest.with_digests(truth).to_json().encode())
    fixed = stage_on(env, "h1", {"model": resolve_source("model", uri, env["access"])})
    assert fixed.kept_files == 1 and fixed.sent_bytes == 1 << 20


def test_an_object_deleted_after_the_plan_is_named_on_its_host(env):
    client = env["client"]
    client.put_object(Bucket=BUCKET, Key="gone/data.jsonl", Body=env["data"].read_bytes())
    source = resolve_source("data", f"s3://{BUCKET}/gone/data.jsonl", env["access"])
    client.delete_object(Bucket=BUCKET, Key="gone/data.jsonl")
    with pytest.raises(StageFailed) as err:
        stage_on(env, "h1", {"data": source})
    assert "host h1" in str(err.value) and f"s3://{BUCKET}/gone/data.jsonl" in str(err.value)
    assert "deleted since the manifest was read" in str(err.value)
    with pytest.raises(ValueError, match="no such object"):  # the next plan names it before any host is touched
        resolve_source("data", f"s3://{BUCKET}/gone/data.jsonl", env["access"])


def test_a_host_without_the_space_fails_before_a_byte_is_sent(env):
    sources = resolve_sources(f"s3://{BUCKET}/models/tiny/", "/somewhere/on/the/hosts",
                              env["access"])
    cache = cache_dir(str(env["base"] / "w-small"))  # a tmpfs seen only in the host's own mount namespace
    abandoned = f"{cache}/partial/abandoned.part"  # a staging given up on a month ago
    with connect(env["inventory"].host("small"), env["inventory"]) as host:
        assert host.run(f"mkdir -p {cache}/partial && head -c 16384 /dev/zero > {abandoned} && "
                        f"touch -d '30 days ago' {abandoned}", 30).ok
        with pytest.raises(StageFailed) as err:
            stage_host(host, sources, env["bundle"].sha256, env["access"])
        text = str(err.value)
        assert err.value.retry is Retry.NEVER and "host small" in text and "nothing sent" in text
        assert f"needs {sources['model'].manifest.size:,} bytes" in text
        assert host.run(f"find {cache}/partial -type f", 30).stdout.split() == [abandoned]
        # the message names the command that frees what no staging used lately, and it does
        assert "frees 16,384 bytes that no staging used for 14 days" in text
        done = host.run(text.split("`")[1], 60)
        assert done.ok and json.loads(done.stdout.removeprefix("STAGE "))["bytes"] == 16384, done
        assert host.run(f"find {cache}/partial -type f", 30).stdout.split() == []


def test_a_model_without_config_json_is_refused_before_any_host(env, tmp_path):
    env["client"].put_object(Bucket=BUCKET, Key="noconfig/model.safetensors", Body=b"x" * 10)
    with pytest.raises(ValueError, match="no config.json"):
        resolve_source("model", f"s3://{BUCKET}/noconfig/", env["access"])
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"model='orchestrator:.*no config.json"):
        resolve_source("model", f"orchestrator:{tmp_path / 'm'}", env["access"])
    with pytest.raises(ValueError, match="no such file"):
        resolve_source("data", f"orchestrator:{tmp_path / 'nothing.jsonl'}", env["access"])


def test_the_flow_stages_a_model_from_s3_and_a_dataset_from_the_orchestrator(env, prefect_server, tmp_path,
                                                                            monkeypatch):
    from prefect_aws import AwsCredentials

    from flows.extract import extract
    from harness.prefect import prefect_records

    monkeypatch.setenv("HSEXTRACT_CACHE", str(tmp_path / "orchestrator-cache"))
    AwsCredentials(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1",
                   aws_client_parameters={"endpoint_url": env["access"].endpoint_url}).save("stage-s3", overwrite=True)
    entries = [ssh_host_entry(env["inventory"].host(n), env["base"] / f"w-{n}", gpus=(0,)) for n in ("h1", "lo")]
    hosts = write_inventory(tmp_path / "hosts.yaml", entries)
    kwargs = dict(model=f"s3://{BUCKET}/models/tiny/", data=f"orchestrator:{env['data']}",
                  output=f"s3://{BUCKET}/runs/staged", hosts=str(hosts), layers="1,3", token_budget=512,
                  run_name="staged", aws_credentials="stage-s3", heartbeat_interval_s=0.5, poll_interval_s=0.3,
                  launch_timeout_s=30, stall_timeout_s=20, host_timeout_s=10)
    state = extract(return_state=True, **kwargs)
    assert state.is_completed(), state.message
    rec = state.result()["reconcile"]
    assert rec["complete"] and rec["done"] + sum(rec["skipped"].values()) == 60
    text = prefect_records(state.state_details.flow_run_id)
    assert "stage-h1" in text and "stage-lo" in text
    # every worker read the staged copies: their argv named the views in the hosts' caches
    for name in ("h1", "lo"):
        argv = [json.loads(p.read_text())["argv"] for p in
                (env["base"] / f"w-{name}" / "runs" / "staged").glob("shard-*/launch.json")]
        assert argv and all(cache_dir(str(env["base"] / f"w-{name}")) in " ".join(a) for a in argv)


def test_hosts_that_disagree_on_a_digest_are_named_and_the_majority_is_written(env):
    from tasks.stage import Source, Staged

    client = env["client"]
    client.put_object(Bucket=BUCKET, Key="vote/data.jsonl", Body=b'{"id": "a"}\n')
    source = resolve_source("data", f"s3://{BUCKET}/vote/data.jsonl", env["access"])
    assert isinstance(source, Source) and not source.manifest.complete
    right = hashlib.sha256(b'{"id": "a"}\n').hexdigest()
    staged = {h: Staged(h, digests={"data": {"data.jsonl": right if h != "h3" else "f" * 64}})
              for h in ("h1", "h2", "h3")}
    settled, odd = settle_manifests({"data": source}, staged, env["access"], Log())
    assert list(odd) == ["h3"] and "differs from 2 other host(s)' in data.jsonl" in odd["h3"]
    assert settled["data"].manifest.files[0].sha256 == right
    kept = client.get_object(Bucket=BUCKET, Key="vote/data.jsonl.hsextract-manifest.json")["Body"].read()
    assert Manifest.from_json(kept.decode()).files[0].sha256 == right


def test_the_preflight_stages_the_inputs_and_checks_the_staged_copies(env, prefect_server, tmp_path):
    from prefect_aws import AwsCredentials

    from flows.preflight import preflight

    AwsCredentials(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1",
                   aws_client_parameters={"endpoint_url": env["access"].endpoint_url}).save("stage-pf", overwrite=True)
    entries = [ssh_host_entry(env["inventory"].host(n), env["base"] / f"w-{n}", gpus=(0,)) for n in ("h1", "small")]
    hosts = write_inventory(tmp_path / "hosts.yaml", entries)
    state = preflight(model=f"s3://{BUCKET}/models/tiny/", data=f"orchestrator:{env['data']}", device="cpu",
                      output=f"s3://{BUCKET}/runs/pf", hosts=str(hosts), layers="1,3", aws_credentials="stage-pf",
                      return_state=True)
    result = state.result(raise_on_failure=False)
    assert state.is_failed() and list(result["problems"]) == ["small"]
    assert "nothing sent" in result["problems"]["small"]["inputs"]
    assert result["hosts"]["h1"]["inputs"] == "ok" and result["hosts"]["h1"]["model"] == "ok"
    assert result["hosts"]["h1"]["dataset"] == "ok" and result["plan"]["samples"] == 60


def test_a_fetch_from_s3_cut_short_resumes_from_its_partial_file(env):
    client = env["client"]
    body = os.urandom(3 << 20)
    client.put_object(Bucket=BUCKET, Key="resume/weights.bin", Body=body)
    listed = resolve_source("data", f"s3://{BUCKET}/resume/weights.bin", env["access"]).manifest
    client.put_object(Bucket=BUCKET, Key="resume/weights.bin.hsextract-manifest.json", Body=listed.with_digests(
        {"weights.bin": hashlib.sha256(body).hexdigest()}).to_json().encode())
    source = resolve_source("data", f"s3://{BUCKET}/resume/weights.bin", env["access"])
    assert source.manifest.complete
    cache = Cache(cache_dir(str(env["base"] / "w-h1")))
    part = cache.partial(source.manifest.files[0], source.manifest.source)
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(body[:(1 << 20) + 7])  # cut mid-part
    got = stage_on(env, "h1", {"data": source})
    assert got.resumed_bytes == (1 << 20) + 7 and got.sent_bytes == len(body) - got.resumed_bytes
    assert Path(got.paths["data"]).read_bytes() == body and not part.exists()
