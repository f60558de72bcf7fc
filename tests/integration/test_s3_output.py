"""The worker with --out s3://: background verified upload, bounded spool, journals mirrored, reconcile."""

from __future__ import annotations

import json
import time

from harness.worker import dataset_ids, run_extract, summary_of
from harness.s3proxy import FaultProxy
from hsextract.store import S3Store
from tasks.reconcile import dataset_ids as ids_of, reconcile_output


def test_s3_output_lands_verified_frees_disk_and_reconciles(tmp_path, tiny_model, dataset, s3, s3_endpoint):
    client, bucket = s3
    spool = tmp_path / "spool"
    for shard in range(2):
        proc = run_extract(tiny_model, dataset, f"s3://{bucket}/run", shard, 2, "--token-budget", "256",
                           "--spool", str(spool), "--s3-endpoint", s3_endpoint)
        assert proc.returncode == 0, proc.stderr
        up = summary_of(proc)["upload"]
        assert up["files"] == summary_of(proc)["files"] > 0
    assert not list(spool.rglob("*.safetensors"))  # every local copy freed after its verification
    report = reconcile_output(S3Store(f"s3://{bucket}/run", client=client), ids_of(dataset), 2, verify=True)
    assert report.complete and report.sealed and report.duplicated == 0 and not report.corrupt_objects
    assert report.expected == len(set(dataset_ids(dataset)))


def test_fresh_host_resumes_from_the_store_and_computes_nothing_twice(tmp_path, tiny_model, dataset, s3,
                                                                        s3_endpoint):
    client, bucket = s3
    args = ("--token-budget", "256", "--s3-endpoint", s3_endpoint)
    first = run_extract(tiny_model, dataset, f"s3://{bucket}/r", 0, 1, *args, "--spool", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    # another host (empty spool), another shard count: everything is already in the store's journals
    for shard in range(3):
        again = run_extract(tiny_model, dataset, f"s3://{bucket}/r", shard, 3, *args,
                            "--spool", str(tmp_path / "b"))
        assert again.returncode == 0, again.stderr
        assert summary_of(again)["samples_written"] == 0 and summary_of(again)["forward_passes"] == 0


def test_high_water_mark_pauses_extraction_until_uploads_catch_up(tmp_path, tiny_model, dataset, s3, s3_endpoint):
    _, bucket = s3

    def slow(method, path):
        if method == "PUT" and ".safetensors" in path:
            time.sleep(0.3)  # a slow link
        return None

    proxy = FaultProxy(s3_endpoint, slow).start()
    try:
        proc = run_extract(tiny_model, dataset, f"s3://{bucket}/w", 0, 1, "--token-budget", "256",
                           "--spool", str(tmp_path / "s"), "--s3-endpoint", proxy.url,
                           "--spool-high-gb", str(1 / 2**30), "--spool-low-gb", str(1 / 2**30))
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stderr
    up = summary_of(proc)["upload"]
    biggest = max(json.loads(l)["bytes"] for l in (tmp_path / "s" / "shard-00000-of-00001" / "journal.jsonl")
                  .read_text().splitlines() if '"kind":"file"' in l)
    assert up["paused_s"] > 0.3 and up["max_spool_bytes"] <= biggest  # never more than one file waiting


def test_upload_errors_past_retries_fail_the_shard_naming_s3(tmp_path, tiny_model, dataset, s3, s3_endpoint):
    _, bucket = s3
    proxy = FaultProxy(s3_endpoint, lambda method, path: 500 if ".safetensors" in path else None).start()
    try:
        proc = run_extract(tiny_model, dataset, f"s3://{bucket}/e", 0, 1, "--token-budget", "256",
                           "--spool", str(tmp_path / "s"), "--s3-endpoint", proxy.url)
    finally:
        proxy.stop()
    assert proc.returncode != 0
    assert "upload to s3://" in proc.stderr and "InternalError" in proc.stderr
    waiting = sorted((tmp_path / "s").rglob("*.safetensors"))
    assert waiting, proc.stderr  # nothing lost: the files wait for the next run

    # one waiting file is altered on disk: the next run cannot upload it, so it redoes its samples instead
    victim = waiting[0]
    data = bytearray(victim.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    victim.write_bytes(bytes(data))
    journal = victim.parent / "journal.jsonl"
    # what the first run journaled before the uploads' failure stopped it (on a loaded machine: maybe not all)
    journaled = {i for e in map(json.loads, journal.read_text().splitlines()) if e["kind"] == "file" for i in e["ids"]}
    again = run_extract(tiny_model, dataset, f"s3://{bucket}/e", 0, 1, "--token-budget", "256",
                        "--spool", str(tmp_path / "s"), "--s3-endpoint", s3_endpoint)
    assert again.returncode == 0, again.stderr
    assert f"{victim.name} holds sha256" in again.stderr and "sample(s) redone" in again.stderr, again.stderr
    entries = [json.loads(l) for l in journal.read_text().splitlines()]
    assert [e["file"] for e in entries if e["kind"] == "lost"] == [victim.name]
    redone = next(len(e["ids"]) for e in entries if e["kind"] == "file" and e["file"] == victim.name)
    never = len(set(dataset_ids(dataset)) - journaled)  # samples the first run never got to
    assert summary_of(again)["samples_written"] == redone + never, (redone, never, again.stdout)
    import hsextract

    ids = sorted(s["id"] for s in hsextract.read_samples(f"s3://{bucket}/e", verify=True, client=s3[0]))
    assert ids == sorted(dataset_ids(dataset))


def test_a_retraction_in_the_store_reaches_a_host_whose_journal_is_ahead(tmp_path, s3):
    """Reconcile appends `lost` to the store's journal; a host that has more entries than the store keeps
    its own journal and takes the retraction too (otherwise the lost samples would never be redone)."""
    from hsextract.output.journal import scan
    from hsextract.output.upload import fetch_journals

    client, bucket = s3
    file_a = {"kind": "file", "file": "batch-000001-a.safetensors", "ids": ["a"], "tokens": 3, "bytes": 9,
              "sha256": "0" * 64, "time": 1.0}
    file_b = {**file_a, "file": "batch-000002-b.safetensors", "ids": ["b"]}
    lost = {"kind": "lost", "file": file_a["file"], "why": "not in the store", "time": 2.0}
    line = lambda e: json.dumps(e, separators=(",", ":")) + "\n"  # noqa: E731
    S3Store(f"s3://{bucket}/p", client=client).write("shard-00000-of-00001/journal.jsonl",
                                                     (line(file_a) + line(lost)).encode())
    local = tmp_path / "shard-00000-of-00001" / "journal.jsonl"
    local.parent.mkdir()
    local.write_text(line(file_a) + line(file_b))  # ahead: file_b is not mirrored yet
    assert fetch_journals(S3Store(f"s3://{bucket}/p", client), tmp_path) == 1
    entries = [json.loads(l) for l in local.read_text().splitlines()]
    assert entries == [file_a, file_b, lost]
    state = scan(tmp_path)
    assert set(state.written) == {"b"}, "a's file is retracted, so a is redone; b stays written"
    assert fetch_journals(S3Store(f"s3://{bucket}/p", client), tmp_path) == 1  # sizes differ, nothing new merged
    assert [json.loads(l) for l in local.read_text().splitlines()] == entries


def journal_files(spool, shard_dir="shard-00000-of-00001"):
    return [json.loads(l) for l in (spool / shard_dir / "journal.jsonl").read_text().splitlines()
            if '"kind":"file"' in l]


def test_upload_from_memory_never_touches_disk_and_reconciles(tmp_path, tiny_model, dataset, s3, s3_endpoint):
    client, bucket = s3
    spool = tmp_path / "spool"
    for shard in range(2):
        proc = run_extract(tiny_model, dataset, f"s3://{bucket}/m", shard, 2, "--token-budget", "256",
                           "--spool", str(spool), "--s3-endpoint", s3_endpoint, "--upload-from", "memory")
        assert proc.returncode == 0, proc.stderr
        summary = summary_of(proc)
        assert summary["upload"]["from_memory"] == summary["files"] == summary["upload"]["files"] > 0
        entries = journal_files(spool, f"shard-{shard:05d}-of-00002")
        assert len(entries) == summary["files"] and all(e["from_memory"] for e in entries)
    assert not list(spool.rglob("*.safetensors")) and not list(spool.rglob(".*.tmp"))
    report = reconcile_output(S3Store(f"s3://{bucket}/m", client=client), ids_of(dataset), 2, verify=True)
    assert report.complete and report.sealed and report.duplicated == 0 and not report.corrupt_objects
    assert report.unjournaled_objects == 0


def test_upload_from_memory_spills_to_disk_when_its_budget_is_full(tmp_path, tiny_model, dataset, s3, s3_endpoint):
    client, bucket = s3

    def slow(method, path):
        if method == "PUT" and ".safetensors" in path:
            time.sleep(0.3)  # the link is slower than extraction: memory fills up
        return None

    budget = 400_000  # about two of these files
    proxy = FaultProxy(s3_endpoint, slow).start()
    try:
        proc = run_extract(tiny_model, dataset, f"s3://{bucket}/sp", 0, 1, "--token-budget", "256",
                           "--spool", str(tmp_path / "s"), "--s3-endpoint", proxy.url, "--upload-from", "memory",
                           "--upload-memory-gb", str(budget / 2**30))
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    up = summary["upload"]
    assert 0 < up["from_memory"] < summary["files"] == up["files"], up  # both paths taken
    assert 0 < up["max_memory_bytes"] <= budget
    spilled = [e for e in journal_files(tmp_path / "s") if not e.get("from_memory")]
    assert len(spilled) == summary["files"] - up["from_memory"]
    assert not list((tmp_path / "s").rglob("*.safetensors"))  # spilled files freed once verified too
    report = reconcile_output(S3Store(f"s3://{bucket}/sp", client=client), ids_of(dataset), 1, verify=True)
    assert report.complete and report.duplicated == 0 and not report.corrupt_objects


def test_upload_from_memory_failure_journals_only_what_is_stored(tmp_path, tiny_model, dataset, s3, s3_endpoint):
    """The store refuses uploads after a few files: the shard fails naming S3; every journaled file is in
    the store, verified (files still in memory were never journaled); a re-run finishes exactly once."""
    client, bucket = s3
    puts = []

    def refuse_after_three(method, path):
        if method == "PUT" and ".safetensors" in path:
            puts.append(path)
            return 403 if len(puts) > 3 else None
        return None

    proxy = FaultProxy(s3_endpoint, refuse_after_three).start()
    spool = tmp_path / "s"
    args = ("--token-budget", "256", "--spool", str(spool), "--upload-from", "memory")
    try:
        proc = run_extract(tiny_model, dataset, f"s3://{bucket}/f", 0, 1, *args, "--s3-endpoint", proxy.url)
    finally:
        proxy.stop()
    assert proc.returncode != 0 and "upload to s3://" in proc.stderr and "AccessDenied" in proc.stderr, proc.stderr
    journaled = journal_files(spool)
    assert journaled, "the first files were stored"
    for entry in journaled:
        if entry.get("from_memory"):
            head = client.head_object(Bucket=bucket, Key=f"f/shard-00000-of-00001/{entry['file']}")
            assert head["Metadata"]["sha256"] == entry["sha256"] and head["ContentLength"] == entry["bytes"]
        else:
            assert (spool / "shard-00000-of-00001" / entry["file"]).exists()
    again = run_extract(tiny_model, dataset, f"s3://{bucket}/f", 0, 1, *args, "--s3-endpoint", s3_endpoint)
    assert again.returncode == 0, again.stderr
    assert summary_of(again)["samples_written"] == len(set(dataset_ids(dataset))) - sum(len(e["ids"]) for e in journaled)
    report = reconcile_output(S3Store(f"s3://{bucket}/f", client=client), ids_of(dataset), 1, verify=True)
    assert report.complete and report.duplicated == 0 and not report.corrupt_objects


def test_upload_from_memory_needs_an_s3_output(tmp_path, tiny_model, dataset):
    proc = run_extract(tiny_model, dataset, tmp_path / "o", 0, 1, "--upload-from", "memory")
    assert proc.returncode == 2 and "--upload-from memory" in proc.stderr and "s3://" in proc.stderr


def test_a_worker_stopped_while_uploading_finishes_its_uploads_in_flight_and_the_next_run_the_rest(
        tmp_path, tiny_model, dataset, s3, s3_endpoint):
    """A stop request and SIGTERM while the link is slow: the uploads in flight finish (within half the
    request's grace), the queued files stay in the spool, journaled, the store's journal names every file
    verified. The multipart upload a killed worker would leave is aborted by the next run, which sends the
    spooled files first; every sample lands once."""
    import signal
    import subprocess

    from harness.worker import extract_cmd

    client, bucket = s3
    status, spool = tmp_path / "status", tmp_path / "spool"

    def slow(method, path):
        if method == "PUT" and "/batch-" in path:
            time.sleep(0.8)
        return None

    proxy = FaultProxy(s3_endpoint, slow).start()
    log = tmp_path / "worker.log"
    try:
        worker = subprocess.Popen(extract_cmd(tiny_model, dataset, f"s3://{bucket}/c", 0, 1, "--token-budget", "256",
                                              "--spool", str(spool), "--s3-endpoint", proxy.url,
                                              "--status-dir", str(status)),
                                  stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        shard = spool / "shard-00000-of-00001"
        deadline = time.monotonic() + 120
        while len(list(shard.glob("batch-*.safetensors"))) < 6:  # a backlog: more queued than in flight
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        (status / "stop.json").write_text(json.dumps({"stop": "cancelled", "why": "test", "grace_s": 20}))
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    finally:
        proxy.stop()
    said = log.read_text()
    record = json.loads((status / "exit.json").read_text())
    assert worker.returncode == 143 and record["stop"] == "cancelled", said
    assert "file(s) uploaded" in record["reason"], record
    journal = [json.loads(l) for l in (shard / "journal.jsonl").read_text().splitlines()]
    journaled = [e["file"] for e in journal if e["kind"] == "file"]
    waiting = sorted(p.name for p in shard.glob("batch-*.safetensors"))
    stored = {o["Key"].rsplit("/", 1)[1] for o in client.list_objects_v2(Bucket=bucket, Prefix="c/")["Contents"]
              if "/batch-" in o["Key"]}
    assert waiting and set(waiting) <= set(journaled), (waiting, journaled)  # nothing lost: queued, journaled
    assert stored and stored | set(waiting) == set(journaled), (stored, waiting, journaled)
    # an upload the stop cut short after its PUT (a loaded machine) left its object stored but its file waiting,
    # unnamed by the mirrored journal: the next run sends it again; nothing else may be in both
    cut = int(record["reason"].split(" upload(s) cut short")[0].rsplit(", ", 1)[1]) \
        if "cut short" in record["reason"] else 0
    assert len(stored & set(waiting)) <= cut, (stored & set(waiting), record["reason"])
    mirrored = client.get_object(Bucket=bucket, Key="c/shard-00000-of-00001/journal.jsonl")["Body"].read().decode()
    named = {json.loads(l)["file"] for l in mirrored.splitlines() if '"kind":"file"' in l}
    assert named <= stored and len(stored - named) <= cut, (named, stored, waiting)

    # what a worker killed mid-part leaves: an unfinished multipart upload under the shard's prefix
    left = client.create_multipart_upload(Bucket=bucket, Key=f"c/shard-00000-of-00001/{waiting[0]}")["UploadId"]
    client.upload_part(Bucket=bucket, Key=f"c/shard-00000-of-00001/{waiting[0]}", UploadId=left, PartNumber=1,
                       Body=b"x" * (5 << 20))
    again = run_extract(tiny_model, dataset, f"s3://{bucket}/c", 0, 1, "--token-budget", "256",
                        "--spool", str(spool), "--s3-endpoint", s3_endpoint, "--status-dir", str(status))
    assert again.returncode == 0, again.stderr
    assert "aborted 1 unfinished multipart upload(s)" in again.stderr, again.stderr
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix="c/").get("Uploads")
    assert summary_of(again)["upload"]["files"] >= len(waiting)
    import hsextract

    ids = sorted(s["id"] for s in hsextract.read_samples(f"s3://{bucket}/c", verify=True, client=client))
    assert ids == sorted(dataset_ids(dataset))
