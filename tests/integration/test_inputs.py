"""Datasets in the formats users keep them in (hsextract/data/inputs.py): the same records and the same sample ids from
JSONL (plain, .gz, .zst), Parquet (a file, a directory of files) and a `datasets` save_to_disk directory; and bad
input named by file and row."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from hsextract.errors import UsageError
from hsextract.data.records import Bad, iter_ids, iter_records
from hsextract.data.assign import shard_of

RECORDS = [
    {"id": "a1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"messages": [{"role": "user", "content": "no id: a content hash"}, {"role": "assistant", "content": "ok"}]},
    {"id": "7", "conversations": [{"from": "human", "value": "sharegpt"}, {"from": "gpt", "value": "yes"}]},
    {"id": "t1", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
    {"id": "bad", "messages": []},
] * 3 + [{"id": f"n{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
         for i in range(40)]


def jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def formats(tmp_path: Path, records=RECORDS) -> dict[str, Path]:
    out = {"jsonl": tmp_path / "d.jsonl", "gz": tmp_path / "d.jsonl.gz", "zst": tmp_path / "d.jsonl.zst",
           "parquet": tmp_path / "d.parquet", "parquet-dir": tmp_path / "pq", "datasets": tmp_path / "hf"}
    out["jsonl"].write_bytes(jsonl(records))
    out["gz"].write_bytes(gzip.compress(jsonl(records)))
    out["zst"].write_bytes(zstandard.ZstdCompressor().compress(jsonl(records)))
    keys = list(dict.fromkeys(k for r in records for k in r))  # every column (from_pylist reads the first row's)
    table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in records])
    pq.write_table(table, out["parquet"])
    out["parquet-dir"].mkdir()
    half = len(records) // 2
    pq.write_table(table.slice(0, half), out["parquet-dir"] / "part-000.parquet")
    pq.write_table(table.slice(half), out["parquet-dir"] / "part-001.parquet")
    import datasets

    datasets.Dataset(table).save_to_disk(str(out["datasets"]), num_shards=2)
    return out


def view(r) -> tuple:
    return (r.id, r.reason) if isinstance(r, Bad) else (r.id, r.messages, r.input_ids, r.loss_mask)


def test_every_format_gives_the_same_records_and_ids(tmp_path):
    paths = formats(tmp_path)
    want = [view(r) for r in iter_records(paths["jsonl"])]
    assert len(want) == len(RECORDS) and sum(1 for w in want if w[-1] == "no_messages") == 3
    ids = [w[0] for w in want]
    assert ids[:4] == ["a1", ids[1], "7", "t1"] and ids[1].startswith("sha256-")  # the content hash of record 2
    for name, path in paths.items():
        assert [view(r) for r in iter_records(path)] == want, name
        assert [i for i, _ in iter_ids(path)] == ids, name  # reconcile's ids: the same
        # so every sample lands in the same shard, whatever the format
        assert [shard_of(i, 7) for i, _ in iter_ids(path)] == [shard_of(i, 7) for i in ids]


def test_a_truncated_gz_is_named_with_the_line_reached(tmp_path):
    whole = gzip.compress(jsonl(RECORDS))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UsageError) as caught:
        list(iter_records(path))
    assert "cut.jsonl.gz" in str(caught.value) and "past line" in str(caught.value), caught.value


def test_parquet_without_a_sample_column_is_named_with_its_columns(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"id": "x", "text": "plain text"}]), tmp_path / "plain.parquet")
    with pytest.raises(UsageError) as caught:
        list(iter_records(tmp_path / "plain.parquet"))
    assert "plain.parquet has no messages/conversations/input_ids column (its columns: id, text)" in str(caught.value)


def test_parquet_files_with_different_columns_are_refused(tmp_path):
    (tmp_path / "mixed").mkdir()
    pq.write_table(pa.Table.from_pylist(RECORDS[:1]), tmp_path / "mixed" / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"id": "t", "input_ids": [1], "loss_mask": [1]}]),
                   tmp_path / "mixed" / "b.parquet")
    with pytest.raises(UsageError) as caught:
        list(iter_records(tmp_path / "mixed"))
    assert "b.parquet and a.parquet have different columns" in str(caught.value), caught.value


def test_what_is_not_a_dataset_is_named(tmp_path):
    import datasets

    with pytest.raises(UsageError, match="no such file or directory"):
        list(iter_records(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="without \\*.parquet files"):
        list(iter_records(tmp_path / "empty"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:2])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UsageError, match="a DatasetDict; name one split's directory \\(train\\)"):
        list(iter_records(tmp_path / "dd"))
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(UsageError, match="corrupt.parquet cannot be read past row 0"):
        list(iter_records(tmp_path / "corrupt.parquet"))


def test_the_worker_runs_a_parquet_dataset_like_its_jsonl(tmp_path, tiny_model):
    """The real CLI (synthetic: no model run) over the same dataset as JSONL and as Parquet: the same samples
    written and skipped, under the same ids, in each shard."""
    paths = formats(tmp_path)
    done = {}
    for name in ("jsonl", "parquet-dir"):
        for shard in range(2):
            out = tmp_path / f"out-{name}"
            run = subprocess.run([sys.executable, "-m", "hsextract", "extract", "--model", str(tiny_model),
                                  "--data", str(paths[name]), "--out", str(out), "--layers", "1", "--shard", str(shard),
                                  "--num-shards", "2", "--synthetic", "100000", "--progress", "log",
                                  "--max-skipped", "1"],  # (its records include ones made to be skipped)
                                 capture_output=True, text=True)
            assert run.returncode == 0, run.stderr[-2000:]
        entries = [json.loads(line) for p in sorted(out.glob("shard-*/journal.jsonl")) for line in p.open()]
        written = sorted(i for e in entries if e.get("kind") == "file" for i in e["ids"])
        skipped = sorted((e["id"], e["reason"]) for e in entries if e.get("kind") == "skip")
        done[name] = (written, skipped)
    assert done["jsonl"] == done["parquet-dir"] and len(done["jsonl"][0]) == len(set(
        r.id for r in iter_records(paths["jsonl"]) if not isinstance(r, Bad)))
    # the orchestrator's reconcile reads the Parquet dataset the workers read: everything accounted for
    from hsextract.store import LocalStore
    from tasks.reconcile import dataset_ids, reconcile_output

    report = reconcile_output(LocalStore(tmp_path / "out-parquet-dir"), dataset_ids(paths["parquet-dir"]), 2)
    assert report.done + sum(report.skipped.values()) == report.expected == 45, report
    assert not report.missing_ids and not report.duplicated and report.sealed, report


def test_an_s3_dataset_given_to_the_worker_itself_says_the_flow_stages_it(tmp_path, tiny_model, capsys):
    from hsextract.cli import main

    code = main(["check", "--model", str(tiny_model), "--data", "s3://bucket/chats/train.parquet", "--out",
                 str(tmp_path / "out"), "--layers", "1", "--shard", "0", "--num-shards", "1"])
    said = capsys.readouterr().err
    assert code == 2 and "--data 's3://bucket/chats/train.parquet': the worker reads a local path" in said
    assert "stages s3:// and orchestrator: sources" in said
