"""Dataset records: rows (JSONL lines, Parquet or Arrow rows: inputs.py) -> chat or pre-tokenized samples with
stable ids (no torch here)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hsextract.data.inputs import id_rows, own_id, rows

# ShareGPT speaker names and the chat-template roles they stand for.
ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}


@dataclass(frozen=True)
class Record:
    """One dataset line that parsed: either `messages` (chat) or `input_ids`/`loss_mask` (pre-tokenized)."""

    id: str
    line: int
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None

    @property
    def digest(self) -> str:
        """xxh3-64 (hex) of what the sample is made from (its messages, or its tokens and mask) as canonical JSON:
        the same record in any format (JSONL, Parquet) has the same one, a record changed under its id another."""
        import xxhash

        body = self.messages if self.messages is not None else [self.input_ids, self.loss_mask]
        return xxhash.xxh3_64(json.dumps(body, sort_keys=True, ensure_ascii=False,
                                         separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Bad:
    """A line that cannot become a sample; it is recorded as skipped under `id` with `reason`."""

    id: str
    line: int
    reason: str
    detail: str = field(default="")


def content_id(obj: object) -> str:
    """Stable id of a record without `id`: hash of its canonical JSON."""
    canonical = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "sha256-" + hashlib.sha256(canonical.encode()).hexdigest()[:24]


def malformed_id(line: int) -> str:
    """The id a line that does not parse is skipped under (its line number)."""
    return f"line-{line}"


def iter_records(path: str | Path, keep: Callable[[str], bool] | None = None) -> Iterator[Record | Bad]:
    """Yield every row of a dataset (JSONL, compressed or not, Parquet, a `datasets` directory: inputs.py) as a
    `Record` or a `Bad`, in file order (rows numbered from 1; a JSONL row by its line). `keep(sample id)`: only
    the rows it keeps are validated and yielded (a shard's own: the others cost their id alone)."""
    for row, raw in rows(Path(path), keep):
        obj = _loaded(raw, row) if isinstance(raw, bytes) else raw
        if isinstance(obj, Bad):
            if keep is None or keep(obj.id):
                yield obj
        elif keep is None or keep(record_id(obj)):
            yield parse_obj(obj, row)


def record_id(obj: dict) -> str:
    """The sample id of a parsed record: its `id` (string or integer), else a hash of its content."""
    found = own_id(obj)
    return found if found is not None else content_id(obj)


def iter_ids(path: str | Path) -> Iterator[tuple[str, int]]:
    """(sample id, row) of every row, exactly the ids `iter_records` gives, without validating."""
    for row, found, raw in id_rows(Path(path)):
        if found is not None:  # an Arrow row's own id, read from its id column alone
            yield found, row
            continue
        if isinstance(raw, dict):
            yield record_id(raw), row
            continue
        assert raw is not None  # a row whose id is not known comes whole (id_rows)
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            yield malformed_id(row), row
            continue
        yield (record_id(obj) if isinstance(obj, dict) else malformed_id(row)), row


def iter_digests(path: str | Path) -> Iterator[tuple[str, str | None]]:
    """(sample id, `Record.digest`) of every row, in file order (None for a row that cannot be a sample): what
    reconcile compares with the journal's `records_xxh3` to find a record changed under its id. Reads and
    parses every record whole, unlike `iter_ids`."""
    for item in iter_records(path):
        yield item.id, (item.digest if isinstance(item, Record) else None)


def parse_line(raw: bytes | str, line_no: int) -> Record | Bad:
    """One JSONL line as a `Record`, or a `Bad` saying why it cannot be a sample."""
    obj = _loaded(raw, line_no)
    return obj if isinstance(obj, Bad) else parse_obj(obj, line_no)


def _loaded(raw: bytes | str, line_no: int) -> dict | Bad:
    """A JSONL line's object, or the `Bad` of a line that is not one."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return Bad(malformed_id(line_no), line_no, "malformed_json", str(exc)[:200])
    if not isinstance(obj, dict):
        return Bad(malformed_id(line_no), line_no, "invalid_record", f"a JSON {type(obj).__name__}, not an object")
    return obj


def parse_obj(obj: dict, line_no: int) -> Record | Bad:
    """One record (a JSONL line's object, an Arrow row) as a `Record`, or a `Bad` saying why it is not a sample."""
    sample_id = record_id(obj)
    try:
        return _to_record(obj, sample_id, line_no)
    except _Invalid as exc:
        return Bad(sample_id, line_no, exc.reason, exc.detail)


class _Invalid(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _to_record(obj: dict, sample_id: str, line_no: int) -> Record:
    if "input_ids" in obj:
        ids, mask = obj["input_ids"], obj.get("loss_mask")
        if not _int_list(ids):
            raise _Invalid("invalid_record", "input_ids must be a list of integers")
        if mask is None or not _int_list(mask) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise _Invalid("invalid_record", "loss_mask must be a list of 0/1 the length of input_ids")
        return Record(sample_id, line_no, input_ids=list(ids), loss_mask=list(mask))
    turns = obj.get("messages", obj.get("conversations"))
    if turns is None:
        raise _Invalid("invalid_record", "no 'messages', 'conversations' or 'input_ids' field")
    if not isinstance(turns, list):
        raise _Invalid("invalid_record", "'messages'/'conversations' must be a list")
    if not turns:
        raise _Invalid("no_messages", "empty conversation")
    return Record(sample_id, line_no, messages=[_message(turn, n) for n, turn in enumerate(turns)])


def _message(turn: object, index: int) -> dict:
    if not isinstance(turn, dict):
        raise _Invalid("invalid_record", f"message {index} is not an object")
    speaker = turn.get("role")
    if speaker is None:  # absent or null (an Arrow struct has every field of its schema)
        speaker = turn.get("from")
    role = ROLE_ALIASES.get(str(speaker).lower()) if speaker is not None else None
    if role is None:
        raise _Invalid("invalid_record", f"message {index} has unknown role {speaker!r}")
    content = turn.get("content")
    if content is None:
        content = turn.get("value")
    if isinstance(content, list):
        content = _join_parts(content, index)
    if not isinstance(content, str):
        raise _Invalid("invalid_record", f"message {index} has no text content")
    return {"role": role, "content": content}


def _join_parts(parts: list, index: int) -> str:
    """OpenAI-style content parts: text parts joined, other kinds (images...) dropped."""
    texts = []
    for part in parts:
        if isinstance(part, dict) and part.get("type", "text") == "text":
            part = part.get("text")
        elif isinstance(part, dict):
            continue
        if not isinstance(part, str):
            raise _Invalid("invalid_record", f"message {index} has a text part that is not a string")
        texts.append(part)
    return "".join(texts)


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
