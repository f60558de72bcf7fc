"""Dataset records: JSONL line -> Record (chat or pre-tokenized) or Bad, with stable ids and line numbers."""

from __future__ import annotations

import json
import re

import pytest

from hsextract.errors import UsageError
from hsextract.data.records import Bad, Record, content_id, iter_records, parse_line


def line(obj) -> str:
    return json.dumps(obj)


def test_messages_record_keeps_roles_and_explicit_id():
    rec = parse_line(line({"id": "abc", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]}), 4)
    assert rec == Record("abc", 4, messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ])


def test_bytes_input_and_integer_id():
    rec = parse_line(line({"id": 17, "messages": [{"role": "user", "content": "hi"}]}).encode(), 1)
    assert isinstance(rec, Record) and rec.id == "17"


def test_sharegpt_conversations_from_value():
    rec = parse_line(line({"id": "g", "conversations": [
        {"from": "system", "value": "sys"},
        {"from": "human", "value": "question"},
        {"from": "gpt", "value": "answer"},
        {"from": "Human", "value": "again"},
        {"from": "GPT", "value": "sure"},
    ]}), 2)
    assert isinstance(rec, Record)
    assert rec.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "sure"},
    ]


def test_openai_content_parts_are_joined_and_non_text_parts_dropped():
    rec = parse_line(line({"messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Hello, "},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            {"type": "text", "text": "world"},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
    ]}), 1)
    assert isinstance(rec, Record)
    assert rec.messages == [{"role": "user", "content": "Hello, world"}, {"role": "assistant", "content": "hi"}]


def test_pretokenized_record():
    rec = parse_line(line({"id": "p", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}), 9)
    assert rec == Record("p", 9, input_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1])
    assert rec.messages is None


# -- content-hash ids ---------------------------------------------------------------------------------

CONV = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "meta": {"a": 1, "b": 2}}


def test_content_id_used_without_id_and_stable_across_key_order():
    reordered = {"meta": {"b": 2, "a": 1},
                 "messages": [{"content": "hi", "role": "user"}, {"content": "yo", "role": "assistant"}]}
    first = parse_line(json.dumps(CONV), 1)
    second = parse_line(json.dumps(reordered, indent=2).replace("\n", " "), 50)
    assert re.fullmatch(r"sha256-[0-9a-f]{24}", first.id)
    assert first.id == second.id == content_id(CONV)


def test_content_id_differs_for_different_content():
    other = {**CONV, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo!"}]}
    ids = {parse_line(json.dumps(CONV), 1).id, parse_line(json.dumps(other), 1).id,
           parse_line(json.dumps({**CONV, "meta": {"a": 1}}), 1).id}
    assert len(ids) == 3


@pytest.mark.parametrize("bad_id", ["", None, True, 1.5, ["x"]])
def test_unusable_id_falls_back_to_content_hash(bad_id):
    obj = {"id": bad_id, **CONV}
    rec = parse_line(json.dumps(obj), 1)
    assert rec.id == content_id(obj)


def test_bad_record_keeps_content_id():
    obj = {"messages": [{"role": "wizard", "content": "hi"}]}
    bad = parse_line(json.dumps(obj), 3)
    assert isinstance(bad, Bad) and bad.id == content_id(obj) and bad.line == 3


# -- bad lines ----------------------------------------------------------------------------------------

def test_iter_records_line_numbers_malformed_and_blank_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        line({"id": "a", "messages": [{"role": "user", "content": "x"}]}) + "\n"   # 1
        + "\n"                                                                     # 2 blank
        + "{not json\n"                                                            # 3
        + "   \n"                                                                  # 4 blank
        + line({"id": "b", "input_ids": [1, 2], "loss_mask": [1, 1]}) + "\n"       # 5
        + '{"id": "c", "messages": [}'                                             # 6, no newline at EOF
    )
    items = list(iter_records(path))
    assert [type(i) for i in items] == [Record, Bad, Record, Bad]
    assert [i.line for i in items] == [1, 3, 5, 6]
    assert [i.id for i in items] == ["a", "line-3", "b", "line-6"]
    assert items[1].reason == items[3].reason == "malformed_json"


def test_invalid_utf8_is_malformed_json(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"id": "a", "messages": []}\n{"id": "\xff\xfe"}\n')
    items = list(iter_records(path))
    assert isinstance(items[1], Bad) and (items[1].id, items[1].line, items[1].reason) == ("line-2", 2, "malformed_json")


@pytest.mark.parametrize("key", ["messages", "conversations"])
def test_empty_conversation_is_no_messages(key):
    bad = parse_line(line({"id": "e", key: []}), 2)
    assert bad == Bad("e", 2, "no_messages", bad.detail)


@pytest.mark.parametrize(
    "obj",
    [
        {"id": "r", "messages": [{"role": "wizard", "content": "hi"}]},
        {"id": "r", "conversations": [{"from": "bot9000", "value": "hi"}]},
        {"id": "r", "messages": [{"content": "no role"}]},
        {"id": "r", "messages": [{"role": "user", "content": "hi"}, "not an object"]},
        {"id": "r", "messages": [{"role": "user", "content": 5}]},
        {"id": "r", "messages": [{"role": "user"}]},
        {"id": "r", "messages": "hi"},
        {"id": "r", "text": "neither messages nor input_ids"},
        {"id": "r", "input_ids": [1, 2, 3]},                                   # no loss_mask
        {"id": "r", "input_ids": [1, 2, 3], "loss_mask": [1, 1]},              # length mismatch
        {"id": "r", "input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]},           # not 0/1
        {"id": "r", "input_ids": [1, 2, 3], "loss_mask": [True, False, True]},  # bools are not ints
        {"id": "r", "input_ids": [1, "2", 3], "loss_mask": [0, 1, 1]},
        {"id": "r", "input_ids": "1 2 3", "loss_mask": [0, 1, 1]},
    ],
)
def test_invalid_records(obj):
    bad = parse_line(line(obj), 7)
    assert isinstance(bad, Bad), bad
    assert (bad.id, bad.line, bad.reason) == ("r", 7, "invalid_record")
    assert bad.detail


@pytest.mark.parametrize("raw", ["[1, 2]", '"a string"', "42", "null"])
def test_non_object_line_is_invalid_record_with_line_id(raw):
    bad = parse_line(raw, 12)
    assert isinstance(bad, Bad)
    assert (bad.id, bad.line, bad.reason) == ("line-12", 12, "invalid_record")


def test_iter_records_missing_file_is_usage_error(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UsageError, match="nope.jsonl"):
        list(iter_records(missing))


def test_iter_records_directory_is_usage_error(tmp_path):
    with pytest.raises(UsageError):
        list(iter_records(tmp_path))


def test_content_part_with_null_text_is_a_bad_record_not_a_crash():
    raw = line({"id": "n", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]})
    bad = parse_line(raw, 1)
    assert isinstance(bad, Bad) and bad.reason == "invalid_record"


def test_iter_ids_gives_exactly_the_ids_of_iter_records(tmp_path):
    from hsextract.data.records import iter_ids

    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([
        line({"id": "a", "messages": [{"role": "user", "content": "x"}]}),
        line({"id": 7, "conversations": []}),             # invalid (empty) but keeps its id
        line({"messages": [{"role": "user", "content": "no id"}]}),
        "{not json",
        "[1, 2]",
        "",
        line({"id": True, "input_ids": [1], "loss_mask": [1]}),  # a bool is not an id: content hash
    ]) + "\n")
    assert list(iter_ids(path)) == [(r.id, r.line) for r in iter_records(path)]
    assert [i for i, _ in iter_ids(path)][:2] == ["a", "7"]
