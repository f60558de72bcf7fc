"""Rows of bad input: malformed and odd dataset lines, a model dir missing a weights file, a layer out of range."""

from __future__ import annotations

import json
import shutil

from .lab import Case, Lab, Outcome, observed


def bad_input(make_args):
    """A parameter or input that must be refused fast, naming it; the re-run uses good input."""
    def run(lab: Lab, case: Case) -> Outcome:
        kwargs = make_args(case)
        state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(), **kwargs)
        return case.finish(observed(state, why), seconds, {"hosts": case.inventory(tag="fixed")}, case.local_out())
    return run


def model_missing_shard(case: Case) -> dict:
    broken = case.base / "model"
    shutil.copytree(case.lab.model, broken)
    weights = sorted(broken.glob("*.safetensors"))
    weights[-1].unlink()
    return {"model": str(broken)}


def bad_lines(lab: Lab, case: Case) -> Outcome:
    """Malformed lines, an empty and an assistant-less conversation, an over-long one, a repeated id."""
    good = [line for line in lab.data.read_text().splitlines()[:30]]
    long_one = {"id": "overlong", "messages": [{"role": "user", "content": "ka " * 80},
                                               {"role": "assistant", "content": "lo " * 300}]}
    lines = [*good[:10], "{not json", json.dumps([1, 2]), json.dumps({"id": "empty", "messages": []}),
             json.dumps({"id": "noasst", "messages": [{"role": "user", "content": "hello there"}]}),
             json.dumps(long_one), good[3], *good[10:]]
    case.data = case.base / "bad.jsonl"
    case.data.write_text("\n".join(lines) + "\n")
    state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(), max_length=128)
    return case.finish(observed(state, why), None, {"hosts": case.inventory(), "max_length": 128},
                       case.local_out(), note="over-long one truncated to 128 tokens")

