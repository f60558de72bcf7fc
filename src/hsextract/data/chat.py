"""Turn records into token ids and a loss mask with the model's own tokenizer and chat template.

Loss mask = assistant tokens. Templates with `{% generation %}` markers give the mask directly; for the
others (Qwen's own templates have none) each assistant message's content is located in the rendered text,
together with the special token that closes the turn right after it, and tokens overlapping those
character spans are supervised.

Over-long policy (`--max-length L`, by default the model's own limit, `max_position_embeddings`): `skip`
(default) records the sample as skipped with reason `too_long`, `truncate` keeps the first L tokens. A
truncated sample is still skipped when what is left cannot train a drafter (fewer than 2 consecutive
supervised tokens). Tokenizing takes memory and time in proportion to the text, so a conversation of more
than L x `BYTES_PER_TOKEN` bytes of text is never tokenized whole: skipped as `too_long` (skip), or its
text cut at that many bytes first (truncate: what the first L tokens come from).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hsextract.data.records import Record
from hsextract.options import OVERLONG_POLICIES


@dataclass(frozen=True)
class Tokenized:
    """A sample ready for the model: its token ids and loss mask (1 = an assistant token to learn)."""
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str = field(default="", compare=False)  # the digest of its record (`Record.digest`), journaled

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Rejected:
    """A sample that cannot train a drafter: skipped with `reason` (journaled, never silent)."""
    id: str
    reason: str
    detail: str = ""


#: the text bytes a token is allowed before a conversation is too long to tokenize whole (real text runs 3-5
#: bytes a token; 16 leaves room for long runs of whitespace or symbols)
BYTES_PER_TOKEN = 16


class ChatEncoder:
    """Encodes records for one tokenizer; `encode` never raises for a bad sample, it returns `Rejected`."""

    def __init__(self, tokenizer, vocab_size: int, max_length: int | None = None, overlong: str = "skip"):
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"overlong policy must be one of {OVERLONG_POLICIES}, got {overlong!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.overlong = overlong
        template = getattr(tokenizer, "chat_template", None) or ""
        self.has_generation_markers = bool(re.search(r"\{%-?\s*generation\s*-?%\}", template))
        self._turn_closers = sorted(
            (t for t in tokenizer.all_special_tokens if t), key=len, reverse=True
        )

    def encode(self, record: Record) -> Tokenized | Rejected:
        """The record's tokens and loss mask (chat template, or pre-tokenized as given), or why it is skipped."""
        if record.input_ids is not None:
            ids, mask = record.input_ids, record.loss_mask
            if any(not 0 <= t < self.vocab_size for t in ids):
                return Rejected(record.id, "invalid_token_id", f"token ids must be in [0, {self.vocab_size})")
            assert mask is not None  # a pre-tokenized record has both (records.parse_obj)
        else:
            messages = record.messages
            assert messages is not None  # a record without input_ids has messages (records.parse_obj)
            cap = self.max_length * BYTES_PER_TOKEN if self.max_length is not None else None
            size = text_bytes(messages)
            if cap is not None and size > cap:
                if self.overlong == "skip":
                    return Rejected(record.id, "too_long", f"{size} bytes of text, over {cap} (--max-length "
                                                           f"{self.max_length} x {BYTES_PER_TOKEN}): not tokenized")
                messages = cut_text(messages, cap)
            try:
                ids, mask = self._encode_chat(messages)
            except Exception as exc:  # a template that raises on one conversation must not kill the shard
                return Rejected(record.id, "template_error", f"{type(exc).__name__}: {exc}"[:300])
        checked = self._check(record.id, list(ids), list(mask))
        if isinstance(checked, Tokenized):
            return Tokenized(checked.id, checked.input_ids, checked.loss_mask, record.digest)
        return checked

    def _check(self, sample_id: str, ids: list[int], mask: list[int]) -> Tokenized | Rejected:
        if not ids:
            return Rejected(sample_id, "empty", "no tokens")
        if self.max_length is not None and len(ids) > self.max_length:
            if self.overlong == "skip":
                return Rejected(sample_id, "too_long", f"{len(ids)} tokens > --max-length {self.max_length}")
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not any(mask):
            return Rejected(sample_id, "no_assistant_tokens", "no supervised (assistant) token")
        if longest_run(mask) < 2:
            return Rejected(sample_id, "too_few_supervised", "fewer than 2 consecutive supervised tokens")
        return Tokenized(sample_id, ids, mask)

    def warm(self) -> None:
        """Run the chat path once on a two-turn conversation: its code imported, its template compiled (before
        another thread tokenizes while this one imports more of transformers, whose lazy imports are not
        thread-safe). A template that refuses this conversation is not an error here."""
        messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
        try:
            self._encode_chat(messages)
        except Exception:  # noqa: BLE001 - the real records say what is wrong with the template
            pass

    def _encode_chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        if not any(m["role"] == "assistant" for m in messages):
            return self._render_ids(messages), []
        if self.has_generation_markers:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = list(out["input_ids"])
            return ids, [int(bool(m)) for m in out["assistant_masks"]]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        spans = self._assistant_spans(text, messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(s < end and begin < e for s, e in spans)) for begin, end in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def _render_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _assistant_spans(self, text: str, messages: list[dict]) -> list[tuple[int, int]]:
        """Character spans of each assistant message's content plus the special token closing its turn.

        Messages are located in order; an occurrence counts only if a special token closes it (so a reply
        "ta" is not found inside the "assistant" role header), else the first occurrence is taken.
        """
        spans, cursor = [], 0
        for message in messages:
            content = message["content"].strip()
            if not content:
                continue
            found, closer_end = self._locate(text, content, cursor)
            if found < 0:
                continue
            cursor = found + len(content)
            if message["role"] == "assistant":
                spans.append((found, closer_end))
        return spans

    def _locate(self, text: str, content: str, cursor: int) -> tuple[int, int]:
        first, found = -1, text.find(content, cursor)
        while found >= 0:
            end = found + len(content)
            rest = text[end:]
            gap = len(rest) - len(rest.lstrip(" \t"))
            closer = next((t for t in self._turn_closers if rest.startswith(t, gap)), None)
            if closer is not None:
                return found, end + gap + len(closer)
            first = found if first < 0 else first
            found = text.find(content, found + 1)
        return first, first + len(content)


def text_bytes(messages: list[dict]) -> int:
    """Bytes of the messages' text (their string contents, and the text parts of multimodal contents)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content.encode(errors="replace"))
        elif isinstance(content, list):
            total += sum(len(str(part.get("text", "")).encode(errors="replace")) for part in content
                         if isinstance(part, dict))
    return total


def cut_text(messages: list[dict], cap: int) -> list[dict]:
    """The conversation cut after `cap` bytes of text: the message that crosses it shortened, the later ones
    dropped (a string content; other contents stop the cut there)."""
    out, left = [], cap
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            out.append(message)
            break
        data = content.encode(errors="replace")
        if len(data) <= left:
            out.append(message)
            left -= len(data)
            continue
        out.append({**message, "content": data[:left].decode(errors="ignore")})
        break
    return out


def longest_run(mask: list[int]) -> int:
    """Length of the longest run of consecutive 1s in a loss mask."""
    best = run = 0
    for m in mask:
        run = run + 1 if m else 0
        best = max(best, run)
    return best
