"""Verified upload of real batch files to a real S3 endpoint (moto), with faults injected by a proxy."""

from __future__ import annotations

import json

import pytest

from harness.worker import run_extract
from harness.s3proxy import FaultProxy

from hsextract.store import s3_client
from hsextract.output.upload import CorruptFile, upload_verified

PART = 5 << 20  # S3's smallest part size


@pytest.fixture(scope="module")
def batches(tmp_path_factory, tiny_model, dataset):
    """(path, journal entry) of real batch files; the first is copied to > 2 parts for multipart."""
    out = tmp_path_factory.mktemp("up") / "out"
    assert run_extract(tiny_model, dataset, out, 0, 1, "--token-budget", "512").returncode == 0
    shard = out / "shard-00000-of-00001"
    entries = [json.loads(l) for l in (shard / "journal.jsonl").read_text().splitlines() if '"kind":"file"' in l]
    return [(shard / e["file"], e) for e in entries]


def fresh_copy(tmp_path, batch, repeat: int = 1):
    """A copy of a batch file (optionally its bytes repeated, for a big one) and the journal values of it."""
    import hashlib

    path, entry = batch
    data = path.read_bytes() * repeat
    copy = tmp_path / f"{path.stem}-x{repeat}.safetensors"
    copy.write_bytes(data)
    return copy, hashlib.sha256(data).hexdigest(), len(data)


def test_single_and_multipart_land_intact_and_free_local_disk(tmp_path, batches, s3, s3_endpoint):
    _, bucket = s3
    client = s3_client(s3_endpoint)
    small, sha, size = fresh_copy(tmp_path, batches[0])
    got = upload_verified(client, small, bucket, "r/small.safetensors", sha, size, part_size=PART)
    assert got.parts == 1 and not small.exists()
    big, big_sha, big_size = fresh_copy(tmp_path, batches[0], repeat=max(3, (2 * PART) // size + 2))
    body = big.read_bytes()
    got = upload_verified(client, big, bucket, "r/big.safetensors", big_sha, big_size, part_size=PART)
    assert got.parts >= 3 and not big.exists()
    assert client.get_object(Bucket=bucket, Key="r/big.safetensors")["Body"].read() == body


def test_file_corrupted_on_disk_is_never_uploaded(tmp_path, batches, s3, s3_endpoint):
    _, bucket = s3
    path, sha, size = fresh_copy(tmp_path, batches[1])
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFile, match="journal wrote"):
        upload_verified(s3_client(s3_endpoint), path, bucket, "r/bad.safetensors", sha, size, part_size=PART)
    assert path.exists()  # kept for the post-mortem; nothing reached the bucket
    assert "Contents" not in s3_client(s3_endpoint).list_objects_v2(Bucket=bucket)


def test_500s_and_throttling_are_retried_nothing_lost(tmp_path, batches, s3, s3_endpoint):
    _, bucket = s3
    count = {"n": 0}

    def flaky(method, path):
        count["n"] += 1
        return {1: 500, 2: 503, 4: 500, 6: 503}.get(count["n"] % 7)

    proxy = FaultProxy(s3_endpoint, flaky).start()
    try:
        client = s3_client(proxy.url, attempts=10)
        for n, batch in enumerate(batches[:3]):
            path, sha, size = fresh_copy(tmp_path, batch, repeat=3 if n == 0 else 1)
            upload_verified(client, path, bucket, f"r/{n}.safetensors", sha, size, part_size=PART, concurrency=2)
    finally:
        proxy.stop()
    faults = sum(1 for i in range(1, count["n"] + 1) if i % 7 in (1, 2, 4, 6))
    assert faults >= 5, f"only {faults} faults injected over {count['n']} requests"
    keys = {o["Key"] for o in s3_client(s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys == {f"r/{n}.safetensors" for n in range(3)}


def test_interrupted_multipart_is_aborted_then_reuploaded(tmp_path, batches, s3, s3_endpoint):
    _, bucket = s3
    path, sha, size = fresh_copy(tmp_path, batches[0], repeat=max(3, (2 * PART) // batches[0][1]["bytes"] + 2))

    def parts_fail(method, path_):
        return 500 if method == "PUT" and "partNumber=2" in path_ else None

    proxy = FaultProxy(s3_endpoint, parts_fail).start()
    try:
        with pytest.raises(Exception, match="InternalError|500"):
            upload_verified(s3_client(proxy.url, attempts=2), path, bucket, "r/m.safetensors", sha, size,
                            part_size=PART, concurrency=1)
    finally:
        proxy.stop()
    direct = s3_client(s3_endpoint)
    assert direct.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # aborted: no orphaned parts
    assert path.exists()
    upload_verified(direct, path, bucket, "r/m.safetensors", sha, size, part_size=PART)
    assert direct.head_object(Bucket=bucket, Key="r/m.safetensors")["ContentLength"] == size
