"""Reconcile real worker output (tiny model, real CLI) on a file:// store: complete, missing, corrupt, duplicate."""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter

import pytest

from harness.worker import dataset_ids, run_extract, summary_of
from hsextract.store import LocalStore
from tasks.reconcile import INDEX_NAME, SUCCESS_NAME, dataset_ids as ids_of, reconcile_output

from hsextract.training.reader import read_samples
from hsextract.data.assign import shard_of


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_model, dataset):
    """One real two-shard run, made once: each test alters its own copy."""
    out = tmp_path_factory.mktemp("reconcile") / "out"
    for shard in range(2):
        proc = run_extract(tiny_model, dataset, out, shard, 2, "--token-budget", "256")
        assert proc.returncode == 0, proc.stderr
        summary_of(proc)
    return out


@pytest.fixture
def output(extracted, tmp_path):
    return shutil.copytree(extracted, tmp_path / "out", ignore=shutil.ignore_patterns(".lock"))


def test_complete_run_is_indexed_and_sealed_once(output, dataset):
    report = reconcile_output(LocalStore(output), ids_of(dataset), 2, verify=True)
    assert report.complete and report.sealed and not report.already_sealed
    assert report.expected == len(set(dataset_ids(dataset))) == report.done + sum(report.skipped.values())
    assert report.missing_objects == [] and report.corrupt_objects == [] and report.duplicated == 0
    index = [json.loads(line) for line in (output / INDEX_NAME).read_text().splitlines()]
    assert len(index) == report.done and len({e["id"] for e in index}) == report.done
    stored = {s["id"]: s for s in read_samples(output)}
    for entry in index[:10]:  # offsets agree with the batch file's own cu_seqlens
        assert entry["end"] - entry["start"] == len(stored[entry["id"]]["input_ids"])
    marker = json.loads((output / SUCCESS_NAME).read_text())
    assert marker["complete"] and marker["done"] == report.done
    again = reconcile_output(LocalStore(output), ids_of(dataset), 2)
    assert again.complete and not again.sealed and again.already_sealed


def test_two_reconcilers_race_for_success_one_wins(output, dataset):
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(reconcile_output(LocalStore(output), ids_of(dataset), 2)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reports) == 4 and sum(r.sealed for r in reports) == 1 and all(r.complete for r in reports)


def test_deleted_object_is_missing_then_the_rerun_restores_it(output, dataset, tiny_model):
    journal = output / "shard-00001-of-00002" / "journal.jsonl"
    entry = next(json.loads(l) for l in journal.read_text().splitlines() if '"kind":"file"' in l)
    (journal.parent / entry["file"]).unlink()
    report = reconcile_output(LocalStore(output), ids_of(dataset), 2, retract=True)
    assert not report.complete and not report.sealed and not (output / SUCCESS_NAME).exists()
    assert report.missing_objects == [f"shard-00001-of-00002/{entry['file']}"]
    assert report.shards_to_rerun == [1] and sorted(report.missing_ids[1]) == sorted(entry["ids"])
    assert "Shards to re-run: [1]" in report.markdown()
    # the journal now says the file is lost: a re-run of shard 1 recomputes exactly those samples
    proc = run_extract(tiny_model, dataset, output, 1, 2, "--token-budget", "256")
    assert proc.returncode == 0, proc.stderr
    assert summary_of(proc)["samples_written"] == len(entry["ids"])
    healed = reconcile_output(LocalStore(output), ids_of(dataset), 2, verify=True)
    assert healed.complete and healed.sealed and healed.duplicated == 0
    assert Counter(s["id"] for s in read_samples(output)) == Counter(set(dataset_ids(dataset)) - set(
        i for i, r in healed_skips(output)))


def healed_skips(output):
    for journal in output.glob("shard-*/journal.jsonl"):
        for line in journal.read_text().splitlines():
            e = json.loads(line)
            if e.get("kind") == "skip":
                yield e["id"], e["reason"]


def test_corrupt_object_is_caught_by_size_and_by_checksum(output, dataset):
    journal = output / "shard-00000-of-00002" / "journal.jsonl"
    entry = next(json.loads(l) for l in journal.read_text().splitlines() if '"kind":"file"' in l)
    path = journal.parent / entry["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(data))
    assert reconcile_output(LocalStore(output), ids_of(dataset), 2, seal=False).complete  # size alone misses it
    report = reconcile_output(LocalStore(output), ids_of(dataset), 2, verify=True)
    assert report.corrupt_objects == [f"shard-00000-of-00002/{entry['file']}"]
    assert not report.complete and sorted(report.missing_ids[0]) == sorted(entry["ids"])


def test_duplicate_copy_resolves_to_one_in_the_index(output, dataset):
    src = output / "shard-00000-of-00002"
    entry = next(json.loads(l) for l in (src / "journal.jsonl").read_text().splitlines() if '"kind":"file"' in l)
    dup = output / "shard-00000-of-00003"  # e.g. a re-sharded run that wrote the same samples again
    dup.mkdir()
    shutil.copy(src / entry["file"], dup / entry["file"])
    (dup / "journal.jsonl").write_text(json.dumps(entry) + "\n")
    report = reconcile_output(LocalStore(output), ids_of(dataset), 2, verify=True)
    assert report.complete and report.duplicated == len(entry["ids"])
    index = [json.loads(line) for line in (output / INDEX_NAME).read_text().splitlines()]
    counts = Counter(e["id"] for e in index)
    assert all(counts[i] == 1 for i in entry["ids"])
    assert all(shard_of(i, 2) == 0 for i in entry["ids"])


def upload(client, bucket: str, prefix: str, out) -> None:
    """What the host-side uploader will do: every file under the output, sha256 kept as object metadata."""
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(out).as_posix()}"
        extra = {"ChecksumAlgorithm": "SHA256"}
        if path.suffix == ".safetensors":
            from hsextract.store import sha256_file

            extra["Metadata"] = {"sha256": sha256_file(path)}
        client.upload_file(str(path), bucket, key, ExtraArgs=extra)


def test_s3_store_reconciles_paginated_and_seals_with_if_none_match(output, dataset, s3):
    from hsextract.store import S3Store

    client, bucket = s3
    upload(client, bucket, "runs/a", output)
    client.put_object(Bucket=bucket, Key="runs/ab/stray.safetensors", Body=b"x")  # a sibling prefix is not ours
    store = S3Store(f"s3://{bucket}/runs/a", client=client)
    store.client.meta.events.register("before-parameter-build.s3.ListObjectsV2",
                                      lambda params, **_: params.setdefault("MaxKeys", 3))  # force many pages
    report = reconcile_output(store, ids_of(dataset), 2, verify=True)
    assert report.complete and report.sealed and report.unjournaled_objects == 0
    index = client.get_object(Bucket=bucket, Key=f"runs/a/{INDEX_NAME}")["Body"].read().decode().splitlines()
    assert len(index) == report.done
    # a second reconciler cannot claim _SUCCESS again: the conditional write refuses it
    assert not store.create(SUCCESS_NAME, b"again")
    again = reconcile_output(store, ids_of(dataset), 2, verify=True)
    assert again.already_sealed and not again.sealed


def test_s3_object_deleted_or_altered_is_reported(output, dataset, s3):
    from hsextract.store import S3Store

    client, bucket = s3
    upload(client, bucket, "p", output)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"] if o["Key"].endswith(".safetensors")]
    client.delete_object(Bucket=bucket, Key=keys[0])
    body = client.get_object(Bucket=bucket, Key=keys[1])["Body"].read()
    client.put_object(Bucket=bucket, Key=keys[1], Body=body[:-1] + bytes([body[-1] ^ 1]),
                      Metadata={"sha256": "0" * 64})  # same size, other bytes
    report = reconcile_output(S3Store(f"s3://{bucket}/p", client=client), ids_of(dataset), 2, verify=True)
    assert not report.complete and not report.sealed
    assert report.missing_objects == [keys[0].removeprefix("p/")]
    assert report.corrupt_objects == [keys[1].removeprefix("p/")]
    assert "_SUCCESS" not in {o["Key"].rsplit("/", 1)[-1] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
