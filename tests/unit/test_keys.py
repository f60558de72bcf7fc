"""Object keys never leave the output prefix: the prefix is checked, and so is every name a journal gives."""

from __future__ import annotations

import posixpath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsextract.output.upload import spool_marks
from hsextract.output.journal import FILE_NAME
from hsextract.store import split_uri


@pytest.mark.parametrize("uri,why", [("s3://b-ok/run/../other", "segment '..'"), ("s3://b-ok/./run", "segment '.'"),
                                     ("s3://b-ok/a//b", "segment ''"), ("s3://b-ok/a\nb", "control character"),
                                     ("s3://B_Bad/x", "not a valid S3 bucket name"), ("s3:///x", "expected")])
def test_prefixes_that_could_escape_are_refused_naming_why(uri, why):
    with pytest.raises(ValueError, match=why.replace(".", r"\.")):
        split_uri(uri)


def test_plain_prefixes_are_kept():
    assert split_uri("s3://bucket-1/runs/qwen36/") == ("bucket-1", "runs/qwen36")
    assert split_uri("s3://bucket.with.dots") == ("bucket.with.dots", "")


@settings(max_examples=400, deadline=None)
@given(prefix=st.text(max_size=30), name=st.text(max_size=20))
def test_every_key_built_from_an_accepted_prefix_and_name_stays_under_the_prefix(prefix, name):
    try:
        _, clean = split_uri(f"s3://bucket-x/{prefix}")
    except ValueError:
        return
    if not FILE_NAME.fullmatch(name):
        return
    key = f"{clean}/shard-00000-of-00001/{name}".lstrip("/")
    assert posixpath.normpath(key) == key and key.startswith(f"{clean}/" if clean else "")


def test_the_spool_marks_fit_the_disk(tmp_path, capsys):
    assert spool_marks(tmp_path, 1 << 20, 1 << 19, "shard 0/1") == (1 << 20, 1 << 19)
    high, low = spool_marks(tmp_path, 1 << 60, 1 << 59, "shard 0/1")
    assert 0 < low < high < 1 << 60 and abs(low * 2 - high) <= 2
    assert "less than the high-water mark" in capsys.readouterr().err
