"""The per-shard journal: append, torn-tail handling, corruption, and merging all shards' journals."""

from __future__ import annotations

import json

import pytest

from hsextract.output.journal import JOURNAL_NAME, Journal, read_entries, shard_dir_name
from hsextract.output.journal import scan


@pytest.fixture
def shard(tmp_path):
    d = tmp_path / shard_dir_name(0, 1)
    d.mkdir()
    return d


def append_all(shard_dir, entries):
    j = Journal(shard_dir)
    try:
        for e in entries:
            j.append(e, durable=e.get("kind") == "file")
    finally:
        j.close()


def strip_time(entries):
    out = []
    for e in entries:
        assert isinstance(e["time"], float)
        out.append({k: v for k, v in e.items() if k != "time"})
    return out


ENTRIES = [
    {"kind": "file", "file": "batch-000001.safetensors", "ids": ["a", "b"], "tokens": 10, "bytes": 99, "sha256": "x"},
    {"kind": "skip", "id": "c", "reason": "too_long", "detail": "", "line": 3},
    {"kind": "done", "summary": {"written": 2}},
]


def test_shard_dir_name():
    assert shard_dir_name(3, 16) == "shard-00003-of-00016"


def test_append_then_read(shard):
    append_all(shard, ENTRIES)
    assert strip_time(read_entries(shard / JOURNAL_NAME)) == ENTRIES


def test_reopen_appends_after_existing(shard):
    append_all(shard, ENTRIES[:1])
    append_all(shard, ENTRIES[1:])
    assert strip_time(read_entries(shard / JOURNAL_NAME)) == ENTRIES


def test_missing_journal_reads_empty(tmp_path):
    assert list(read_entries(tmp_path / "nope" / JOURNAL_NAME)) == []


def test_torn_last_line_ignored_then_cut_before_next_append(shard):
    append_all(shard, ENTRIES[:2])
    path = shard / JOURNAL_NAME
    complete = path.read_bytes()
    with path.open("ab") as handle:
        handle.write(b'{"kind":"file","file":"batch-000002.safe')  # killed mid-append
    assert strip_time(read_entries(path)) == ENTRIES[:2]

    j = Journal(shard)
    assert path.read_bytes() == complete, "torn tail cut when the journal is opened"
    j.append(ENTRIES[2])
    j.close()
    assert strip_time(read_entries(path)) == ENTRIES
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(l) for l in lines[:-1])


def test_corrupt_line_that_is_not_last_raises(shard):
    append_all(shard, ENTRIES[:1])
    path = shard / JOURNAL_NAME
    with path.open("ab") as handle:
        handle.write(b"garbage{\n")
    append_all(shard, ENTRIES[1:2])
    with pytest.raises(ValueError) as info:
        list(read_entries(path))
    assert str(path) in str(info.value) and ":2:" in str(info.value)


def test_corrupt_complete_last_line_raises(shard):
    """A line that ends in a newline was fully appended: if it does not parse, that is corruption."""
    append_all(shard, ENTRIES[:1])
    path = shard / JOURNAL_NAME
    with path.open("ab") as handle:
        handle.write(b"garbage{\n")
    with pytest.raises(ValueError, match="corrupt"):
        list(read_entries(path))


def test_entry_missing_only_its_newline_is_treated_the_same_by_reader_and_appender(shard):
    append_all(shard, ENTRIES[:1])
    path = shard / JOURNAL_NAME
    with path.open("ab") as handle:
        handle.write(json.dumps({**ENTRIES[1], "time": 1.0}, separators=(",", ":")).encode())
    before = list(read_entries(path))
    Journal(shard).close()
    after = list(read_entries(path))
    assert before == after


def write_journal(out, shard, num_shards, entries):
    d = out / shard_dir_name(shard, num_shards)
    d.mkdir(parents=True, exist_ok=True)
    append_all(d, entries)
    return d.name


def file_entry(name, ids):
    return {"kind": "file", "file": name, "ids": ids, "tokens": 1, "bytes": 1, "sha256": "s"}


def skip_entry(sample_id, reason, line):
    return {"kind": "skip", "id": sample_id, "reason": reason, "detail": "", "line": line}


def test_scan_output_merges_shards(tmp_path):
    out = tmp_path / "out"
    s0 = write_journal(out, 0, 2, [
        file_entry("batch-000001.safetensors", ["a", "b"]),
        skip_entry("c", "too_long", 3),
        skip_entry("a", "duplicate_id", 7),
        skip_entry("z", "duplicate_id", 9),  # only ever seen as a duplicate
        {"kind": "done", "summary": {}},
    ])
    s1 = write_journal(out, 1, 2, [
        file_entry("batch-000001.safetensors", ["b", "d"]),  # b again: the first writer (shard 0) wins
        skip_entry("e", "no_messages", 5),
        skip_entry("c", "oom", 3),                            # first skip reason wins too
    ])
    # things that are not shard journals are ignored
    (out / "other").mkdir()
    (out / "other" / JOURNAL_NAME).write_text(json.dumps(file_entry("x", ["ghost"])) + "\n")

    state = scan(out)
    assert state.written == {
        "a": (s0, "batch-000001.safetensors"),
        "b": (s0, "batch-000001.safetensors"),
        "d": (s1, "batch-000001.safetensors"),
    }
    assert state.skipped == {"c": "too_long", "e": "no_messages"}
    assert state.duplicates == {("a", 7), ("z", 9)}
    assert [(s, e["ids"]) for s, e in state.files] == [(s0, ["a", "b"]), (s1, ["b", "d"])]
    assert state.done_shards == {s0}
    for sample_id in "abcde":
        assert state.finished(sample_id), sample_id
    assert not state.finished("z")
    assert not state.finished("ghost")


def test_scan_output_merges_earlier_shard_counts(tmp_path):
    out = tmp_path / "out"
    old = write_journal(out, 0, 1, [file_entry("batch-000001.safetensors", ["a"])])
    new = write_journal(out, 1, 4, [file_entry("batch-000001.safetensors", ["a", "b"])])
    state = scan(out)
    assert state.written == {"a": (old, "batch-000001.safetensors"), "b": (new, "batch-000001.safetensors")}


def test_scan_output_empty_dir(tmp_path):
    state = scan(tmp_path)
    assert (state.written, state.skipped, state.files, state.duplicates) == ({}, {}, [], set())


def test_scan_output_ignores_torn_tail(tmp_path):
    out = tmp_path / "out"
    name = write_journal(out, 0, 1, [file_entry("batch-000001.safetensors", ["a"])])
    with (out / name / JOURNAL_NAME).open("ab") as handle:
        handle.write(b'{"kind":"file","file":"batch-000002.safetensors","ids":["b"')
    state = scan(out)
    assert set(state.written) == {"a"}


def test_lost_entry_retracts_a_file_so_its_samples_are_not_written(shard):
    append_all(shard, [
        {"kind": "file", "file": "batch-000000.safetensors", "ids": ["a", "b"], "bytes": 1, "sha256": "x"},
        {"kind": "file", "file": "batch-000001.safetensors", "ids": ["c"], "bytes": 1, "sha256": "y"},
        {"kind": "done", "summary": {}},
        {"kind": "lost", "file": "batch-000000.safetensors", "why": "not in the store"},
    ])
    state = scan(shard.parent)
    assert set(state.written) == {"c"} and not state.finished("a") and not state.finished("b")
    assert [e["file"] for _, e in state.files] == ["batch-000001.safetensors"]


@pytest.mark.parametrize("name", ["../other/batch-000001.safetensors", "/etc/passwd", ".hidden", "a/b", "", 7,
                                  "x\nbatch"])
def test_a_journal_may_name_only_plain_files_of_its_own_dir(name):
    from hsextract.output.journal import parse_entries

    line = json.dumps({"kind": "file", "file": name, "ids": ["a"], "bytes": 1, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="not a plain file name"):
        list(parse_entries(line.encode() + b"\n", "s3://b/p/shard-00000-of-00001/journal.jsonl"))
    good = line.replace(json.dumps(name), '"batch-000001.safetensors"')
    assert list(parse_entries(good.encode() + b"\n", "j"))[0]["file"] == "batch-000001.safetensors"
