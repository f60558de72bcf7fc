"""Chat encoding: token ids + assistant loss mask, with and without {% generation %} markers."""

from __future__ import annotations

import random

import pytest

from hsextract import tiny
from hsextract.data.chat import ChatEncoder, Rejected, Tokenized, longest_run
from hsextract.data.records import Record


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    return (tiny.build_tokenizer(base / "markers", generation_markers=True),
            tiny.build_tokenizer(base / "fallback", generation_markers=False))


@pytest.fixture(scope="module")
def marker_tok(tokenizers):
    return tokenizers[0]


@pytest.fixture(scope="module")
def fallback_tok(tokenizers):
    return tokenizers[1]


def encoder(tok, **kwargs) -> ChatEncoder:
    return ChatEncoder(tok, vocab_size=len(tok), **kwargs)


def chat(messages, sample_id="c") -> Record:
    return Record(sample_id, 1, messages=messages)


def pretok(ids, mask, sample_id="p") -> Record:
    return Record(sample_id, 1, input_ids=ids, loss_mask=mask)


def supervised_runs(tok, result: Tokenized) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    runs, current = [], []
    for token, m in zip(result.input_ids, result.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def test_template_kind_detected(marker_tok, fallback_tok):
    assert encoder(marker_tok).has_generation_markers
    assert not encoder(fallback_tok).has_generation_markers


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_marker_and_fallback_paths_agree(marker_tok, fallback_tok, seed):
    rng = random.Random(seed)
    with_markers, fallback = encoder(marker_tok), encoder(fallback_tok)
    for n in range(10):
        conv = tiny.make_conversation(rng, f"c{n}", turns=rng.randint(1, 4), words_per_turn=rng.choice([3, 8, 20]))
        a, b = with_markers.encode(chat(conv["messages"])), fallback.encode(chat(conv["messages"]))
        assert isinstance(a, Tokenized) and isinstance(b, Tokenized)
        assert a.input_ids == b.input_ids
        assert a.loss_mask == b.loss_mask
        assert len(a.loss_mask) == len(a.input_ids) and 0 < sum(a.loss_mask) < len(a.loss_mask)


@pytest.mark.parametrize("which", ["markers", "fallback"])
def test_single_turn_supervises_exactly_the_reply_and_im_end(tokenizers, which):
    tok = tokenizers[0] if which == "markers" else tokenizers[1]
    reply = "ka lomi ne, 42 rutavo?"
    result = encoder(tok).encode(chat([{"role": "user", "content": "shi pra den qua"},
                                       {"role": "assistant", "content": reply}]))
    assert isinstance(result, Tokenized)
    assert supervised_runs(tok, result) == [reply + "<|im_end|>"]
    # and the whole sequence is the rendered template
    assert tok.decode(result.input_ids, skip_special_tokens=False) == (
        "<|im_start|>user\nshi pra den qua<|im_end|>\n<|im_start|>assistant\n" + reply + "<|im_end|>\n")


@pytest.mark.parametrize("which", ["markers", "fallback"])
@pytest.mark.parametrize("seed", [10, 11])
def test_only_assistant_turns_are_supervised(tokenizers, which, seed):
    tok = tokenizers[0] if which == "markers" else tokenizers[1]
    rng = random.Random(seed)
    for _ in range(5):
        conv = tiny.make_conversation(rng, None, turns=3, words_per_turn=6)
        messages = [{"role": "system", "content": "sys prompt " + " ".join(rng.choices(tiny.WORDS, k=4))}]
        messages += [m for m in conv["messages"] if m["role"] != "system"]
        result = encoder(tok).encode(chat(messages))
        assert isinstance(result, Tokenized)
        expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert supervised_runs(tok, result) == expected


@pytest.mark.parametrize("which", ["markers", "fallback"])
def test_no_assistant_message_is_rejected(tokenizers, which):
    tok = tokenizers[0] if which == "markers" else tokenizers[1]
    result = encoder(tok).encode(chat([{"role": "system", "content": "ka lo"},
                                       {"role": "user", "content": "mi ne ru"}], "q"))
    assert result == Rejected("q", "no_assistant_tokens", result.detail)


def test_pretokenized_passes_through(marker_tok):
    result = encoder(marker_tok).encode(pretok([3, 4, 5, 6], [0, 1, 1, 0]))
    assert result == Tokenized("p", [3, 4, 5, 6], [0, 1, 1, 0])


def test_isolated_single_supervised_tokens_are_too_few(marker_tok):
    result = encoder(marker_tok).encode(pretok([3, 4, 5, 6], [0, 1, 0, 1]))
    assert isinstance(result, Rejected) and result.reason == "too_few_supervised"


def test_pretokenized_all_zero_mask_is_no_assistant_tokens(marker_tok):
    result = encoder(marker_tok).encode(pretok([3, 4, 5], [0, 0, 0]))
    assert isinstance(result, Rejected) and result.reason == "no_assistant_tokens"


def test_pretokenized_empty_is_rejected(marker_tok):
    result = encoder(marker_tok).encode(pretok([], []))
    assert isinstance(result, Rejected) and result.reason == "empty"


@pytest.mark.parametrize("bad_token", ["vocab", -1, 10**9])
def test_pretokenized_out_of_vocab_token(marker_tok, bad_token):
    vocab = len(marker_tok)
    token = vocab if bad_token == "vocab" else bad_token
    result = encoder(marker_tok).encode(pretok([1, token, 2], [0, 1, 1]))
    assert isinstance(result, Rejected) and result.reason == "invalid_token_id"
    # the largest valid id is accepted
    assert isinstance(encoder(marker_tok).encode(pretok([1, vocab - 1, 2], [0, 1, 1])), Tokenized)


LONG_CHAT = [{"role": "user", "content": "ka lo mi"},
             {"role": "assistant", "content": " ".join(tiny.WORDS[:40])},
             {"role": "user", "content": "ne ru ta vo"},
             {"role": "assistant", "content": "shi pra den qua zel"}]


@pytest.mark.parametrize("which", ["markers", "fallback"])
def test_truncate_keeps_the_first_max_length_tokens(tokenizers, which):
    tok = tokenizers[0] if which == "markers" else tokenizers[1]
    full = encoder(tok).encode(chat(LONG_CHAT))
    assert isinstance(full, Tokenized)
    first_supervised = full.loss_mask.index(1)
    limit = first_supervised + 6
    assert limit < len(full)
    cut = encoder(tok, max_length=limit, overlong="truncate").encode(chat(LONG_CHAT))
    assert cut == Tokenized("c", full.input_ids[:limit], full.loss_mask[:limit])
    # exactly at the limit nothing is cut
    assert encoder(tok, max_length=len(full), overlong="truncate").encode(chat(LONG_CHAT)) == full


def test_truncate_that_removes_every_assistant_token_is_rejected(marker_tok):
    full = encoder(marker_tok).encode(chat(LONG_CHAT))
    limit = full.loss_mask.index(1)  # cut right before the first supervised token
    result = encoder(marker_tok, max_length=limit, overlong="truncate").encode(chat(LONG_CHAT))
    assert isinstance(result, Rejected) and result.reason == "no_assistant_tokens"


def test_truncate_leaving_one_supervised_token_is_too_few(marker_tok):
    result = encoder(marker_tok, max_length=3, overlong="truncate").encode(pretok([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]))
    assert isinstance(result, Rejected) and result.reason == "too_few_supervised"


def test_skip_is_the_default_policy_and_a_huge_text_is_not_tokenized(marker_tok):
    from hsextract.data.chat import BYTES_PER_TOKEN

    huge = chat([{"role": "user", "content": "ka " * 400}, {"role": "assistant", "content": "lo " * 400}])
    result = encoder(marker_tok, max_length=20).encode(huge)
    assert isinstance(result, Rejected) and result.reason == "too_long"
    assert f"over {20 * BYTES_PER_TOKEN} (--max-length 20 x {BYTES_PER_TOKEN}): not tokenized" in result.detail
    # truncate: the text is cut at the cap first, and the first 20 tokens are those of the whole conversation
    cut = encoder(marker_tok, max_length=20, overlong="truncate").encode(huge)
    whole = encoder(marker_tok).encode(huge)
    assert isinstance(cut, Rejected) or cut.input_ids == whole.input_ids[:20]


def test_skip_policy_rejects_too_long(marker_tok):
    full = encoder(marker_tok).encode(chat(LONG_CHAT))
    result = encoder(marker_tok, max_length=len(full) - 1, overlong="skip").encode(chat(LONG_CHAT))
    assert isinstance(result, Rejected) and result.reason == "too_long" and result.id == "c"
    assert encoder(marker_tok, max_length=len(full), overlong="skip").encode(chat(LONG_CHAT)) == full
    # pre-tokenized records are subject to the same policy
    skipped = encoder(marker_tok, max_length=2, overlong="skip").encode(pretok([1, 2, 3], [0, 1, 1]))
    assert isinstance(skipped, Rejected) and skipped.reason == "too_long"


@pytest.mark.parametrize("policy", ["drop", "TRUNCATE", "", None])
def test_invalid_overlong_policy(marker_tok, policy):
    with pytest.raises(ValueError):
        ChatEncoder(marker_tok, vocab_size=len(marker_tok), max_length=10, overlong=policy)


@pytest.mark.parametrize(
    "mask, expected",
    [([], 0), ([0, 0], 0), ([1], 1), ([0, 1, 0, 1], 1), ([1, 1, 0, 1, 1, 1, 0], 3), ([0, 1, 1, 1, 1], 4),
     ([1, 1, 1, 0, 1], 3)],
)
def test_longest_run(mask, expected):
    assert longest_run(mask) == expected


@pytest.mark.parametrize("reply", ["ta", "assistant"])
def test_fallback_agrees_when_reply_also_occurs_in_role_header(marker_tok, fallback_tok, reply):
    messages = [{"role": "user", "content": "ka lo mi"}, {"role": "assistant", "content": reply}]
    a = encoder(marker_tok).encode(chat(messages))
    b = encoder(fallback_tok).encode(chat(messages))
    assert isinstance(a, Tokenized)
    assert supervised_runs(marker_tok, a) == [reply + "<|im_end|>"]
    assert b == a
