"""The storage layer (hsextract.store) on a real directory and a real S3 endpoint (moto): the same contract on both."""

from __future__ import annotations

import json
import threading

import pytest

from hsextract.output.journal import line
from hsextract.store import LocalStore, NoSuchBucket, S3Store, open_store
from hsextract.output.journal import scan


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "out")
    client, bucket = request.getfixturevalue("s3")
    return S3Store(f"s3://{bucket}/runs/one", client)


def test_write_read_list_delete_and_checksums(store):
    import hashlib

    store.write("shard-00000-of-00001/batch-000001.safetensors", b"tensor bytes")
    store.write("_index.jsonl", b"{}\n")
    assert store.read("_index.jsonl") == b"{}\n"
    listed = {o.key: o for o in store.list(checksums=True)}
    assert set(listed) == {"shard-00000-of-00001/batch-000001.safetensors", "_index.jsonl"}
    batch = listed["shard-00000-of-00001/batch-000001.safetensors"]
    assert batch.size == 12 and listed["_index.jsonl"].sha256 is None
    if isinstance(store, LocalStore):  # computed from the bytes
        assert batch.sha256 == hashlib.sha256(b"tensor bytes").hexdigest()
    else:  # the uploader's metadata: none was stored with this object
        assert batch.sha256 is None
    store.delete("_index.jsonl")
    store.delete("_index.jsonl")  # absent: nothing to do
    with pytest.raises(FileNotFoundError, match="_index.jsonl"):
        store.read("_index.jsonl")


def test_create_is_write_if_absent_and_replace_is_write_if_match(store):
    assert store.create("_SUCCESS", b"first")
    assert not store.create("_SUCCESS", b"second")
    data, tag = store.read_tagged("_SUCCESS")
    assert data == b"first"
    assert store.replace("_SUCCESS", b"changed", tag)
    assert not store.replace("_SUCCESS", b"stale", tag), "the version it was read at is gone"
    assert store.read("_SUCCESS") == b"changed"


def test_concurrent_updates_lose_nothing(store):
    key = "_runs/r/attempts.json"

    def bump(data):
        counts = json.loads(data) if data else {"n": 0}
        return json.dumps({"n": counts["n"] + 1}).encode()

    threads = [threading.Thread(target=lambda: [store.update(key, bump, attempts=50) for _ in range(5)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(store.read(key)) == {"n": 20}


def test_append_lines_cuts_a_torn_tail_first(store):
    key = "shard-00000-of-00001/journal.jsonl"
    whole = line({"kind": "skip", "id": "a", "reason": "too_long"})
    store.write(key, whole + b'{"kind":"file","file":"batch-0')  # a kill mid-append
    store.append_lines(key, line({"kind": "lost", "file": "x", "why": "test"}))
    entries = [json.loads(raw) for raw in store.read(key).splitlines()]
    assert [e["kind"] for e in entries] == ["skip", "lost"]
    with pytest.raises(FileNotFoundError):
        store.append_lines("shard-00009-of-00010/journal.jsonl", whole)


def test_scan_merges_journals_and_a_lost_entry_reopens_a_done_shard(store):
    file_entry = {"kind": "file", "file": "batch-000001.safetensors", "ids": ["a", "b"], "tokens": 2, "bytes": 3,
                  "sha256": "0" * 64}
    store.write("shard-00000-of-00002/journal.jsonl", line(file_entry) + line({"kind": "done", "summary": {}}))
    store.write("shard-00001-of-00002/journal.jsonl", line({**file_entry, "ids": ["c"]})
                + line({"kind": "done", "summary": {}}) + line({"kind": "lost", "file": file_entry["file"], "why": "t"}))
    store.write("shard-00000-of-00002/batch-000001.safetensors", b"abc")
    state = scan(store)
    assert state.done(0, 2) and not state.done(1, 2), "a retraction after `done` reopens the shard"
    assert set(state.written) == {"a", "b"} and state.lost == {("shard-00001-of-00002", file_entry["file"])}
    assert "shard-00000-of-00002/batch-000001.safetensors" in state.objects


def test_open_store_tells_the_schemes_apart(tmp_path, s3):
    client, bucket = s3
    assert isinstance(open_store(tmp_path), LocalStore) and isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    made = []
    remote = open_store(f"s3://{bucket}/p", client=lambda: made.append(1) or client)
    assert isinstance(remote, S3Store) and made == [1]
    assert open_store(f"file://{tmp_path}", client=lambda: made.append(2)).local_path("") == tmp_path
    assert made == [1], "a client is made only for s3://"
    with pytest.raises(ValueError, match="expected a local path"):
        open_store("ftp://host/x")


def test_a_missing_bucket_is_named(s3):
    client, _ = s3
    with pytest.raises(NoSuchBucket, match="hsx-absent-bucket.*does not exist"):
        S3Store("s3://hsx-absent-bucket/run", client).list()


def test_read_into_fills_a_buffer_in_place_and_refuses_a_short_one(store):
    import os

    data = os.urandom((8 << 20) + 12345)  # more than one of S3's read_into steps
    store.write("shard-00000-of-00001/batch-000001.safetensors", data)
    buffer = bytearray(len(data) + 7)
    assert store.read_into("shard-00000-of-00001/batch-000001.safetensors", buffer) == len(data)
    assert buffer[:len(data)] == data and buffer[len(data):] == bytes(7)
    with pytest.raises(ValueError, match=f"batch-000001.safetensors: {len(data)} bytes, expected at most 100"):
        store.read_into("shard-00000-of-00001/batch-000001.safetensors", bytearray(100))
    with pytest.raises(FileNotFoundError, match="batch-000002"):
        store.read_into("shard-00000-of-00001/batch-000002.safetensors", buffer)
