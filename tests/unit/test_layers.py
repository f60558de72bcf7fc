"""Layer-id contract: DFlash / EAGLE-3 presets and `--layers` SPEC parsing."""

from __future__ import annotations

import pytest

from hsextract.errors import UsageError
from hsextract.run.layers import dflash_layer_ids, eagle3_layer_ids, parse_layer_spec


def test_dflash_five_draft_layers_on_64():
    assert dflash_layer_ids(64, 5) == [1, 16, 31, 46, 61]


def test_dflash_spans_layer_1_to_l_minus_3():
    # 1 + i * 32 / 3 = 1, 11.67, 22.33, 33 -> rounded to the nearest layer, not truncated
    assert dflash_layer_ids(36, 4) == [1, 12, 22, 33]
    assert dflash_layer_ids(40, 3) == [1, 19, 37]


def test_dflash_single_draft_layer_is_the_middle():
    assert dflash_layer_ids(64, 1) == [32]
    assert dflash_layer_ids(8, 1) == [4]


def test_eagle3_low_mid_high():
    assert eagle3_layer_ids(64) == [1, 31, 60]
    assert eagle3_layer_ids(32) == [1, 15, 28]


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("dflash:5", [1, 16, 31, 46, 61]),
        ("dflash:1", [32]),
        ("eagle3", [1, 31, 60]),
        ("1,16,31", [1, 16, 31]),
        ("0,63", [0, 63]),
        (" 31,1 ", [31, 1]),  # surrounding blanks tolerated, order kept as given
        ("eagle3+last", [1, 31, 60, 63]),  # + the last decoder layer (speculators' verifier slot)
        ("dflash:5+last", [1, 16, 31, 46, 61, 63]),
        ("1,63+last", [1, 63]),  # already there: not twice
    ],
)
def test_parse_layer_spec_valid(spec, expected):
    assert parse_layer_spec(spec, 64) == expected


@pytest.mark.parametrize(
    "spec, must_mention",
    [
        ("dflash:0", ["'dflash:0'"]),
        ("dflash:x", ["'dflash:x'"]),
        ("dflash:-2", ["'dflash:-2'"]),
        ("dflash:", ["'dflash:'"]),
        ("1,a", ["'1,a'"]),
        ("", ["''"]),
        ("1,1", ["'1,1'", "repeat"]),
        ("1,64", ["'1,64'", "[64]"]),
        ("3,100,200", ["'3,100,200'", "[100, 200]"]),
        ("-1,3", ["'-1,3'", "[-1]"]),
        ("dflash:64", ["'dflash:64'", "repeat"]),  # more draft layers than distinct ids
        ("1,a+last", ["'1,a+last'", "+last"]),
        ("1,99+last", ["'1,99+last'", "[99]"]),
        ("last", ["'last'"]),
    ],
)
def test_parse_layer_spec_rejects_bad_specs_naming_them(spec, must_mention):
    with pytest.raises(UsageError) as info:
        parse_layer_spec(spec, 64)
    message = str(info.value)
    for fragment in must_mention:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_parse_layer_spec_range_depends_on_model_depth():
    assert parse_layer_spec("6", 8) == [6]
    with pytest.raises(UsageError, match=r"\[8\]"):
        parse_layer_spec("8", 8)


def test_parse_layer_spec_unicode_digit_count_is_a_usage_error():
    with pytest.raises(UsageError):
        parse_layer_spec("dflash:\u00b2", 64)
