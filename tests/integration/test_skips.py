"""Every sample that cannot train a drafter is skipped with a recorded reason, and the shard completes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hsextract
from hsextract import tiny
from hsextract.output.journal import read_entries

from harness import faulty
from harness.worker import run_extract, summary_of

NAN_TOKEN = 300


def good(rng, sample_id):
    return json.dumps(tiny.make_conversation(rng, sample_id, 1, 8))


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("window", ["1024", "3"])
def test_every_skip_reason_recorded(tiny_model, tmp_path, window):
    """Window 1024: every record is tokenized while the model loads (`EarlyTokens`); window 3: the first three
    are, the rest on the forward loop."""
    import random

    rng = random.Random(0)
    long_conv = {"id": "long", "messages": [{"role": "user", "content": "ka " * 50},
                                            {"role": "assistant", "content": "lo " * 200}]}
    lines = [
        good(rng, "g1"),
        "{not json",                                                                      # line 2
        json.dumps([1, 2, 3]),                                                            # line 3
        json.dumps({"id": "empty", "messages": []}),
        json.dumps({"id": "noasst", "messages": [{"role": "user", "content": "hi there"}]}),
        json.dumps({"id": "onetok", "input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 1, 0, 1, 0]}),
        json.dumps(long_conv),
        good(rng, "g1"),                                                                  # duplicate id, line 8
        json.dumps({"id": "badrole", "messages": [{"role": "wizard", "content": "x"}]}),
        json.dumps({"id": "badtok", "input_ids": [1, 999999, 3], "loss_mask": [1, 1, 1]}),
        good(rng, "g2"),
    ]
    data = write_lines(tmp_path / "data.jsonl", lines)
    out = tmp_path / "out"
    proc = run_extract(tiny_model, data, out, 0, 1, "--max-length", "128", "--overlong", "skip", "--max-skipped", "1",
                       "--sort-window", window)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["skipped"] == {
        "malformed_json": 1, "invalid_record": 2, "no_messages": 1, "no_assistant_tokens": 1,
        "too_few_supervised": 1, "too_long": 1, "duplicate_id": 1, "invalid_token_id": 1,
    }
    skips = {(e["id"], e["reason"]): e for e in read_entries(out / "shard-00000-of-00001" / "journal.jsonl")
             if e["kind"] == "skip"}
    assert skips[("line-2", "malformed_json")]["line"] == 2
    assert skips[("line-3", "invalid_record")]["line"] == 3
    assert skips[("g1", "duplicate_id")]["line"] == 8
    assert "wizard" in skips[("badrole", "invalid_record")]["detail"]
    assert sorted(s["id"] for s in hsextract.read_samples(out)) == ["g1", "g2"]
    # a re-run neither re-records the skips nor recomputes anything
    again = summary_of(run_extract(tiny_model, data, out, 0, 1, "--max-length", "128", "--overlong", "skip",
                                   "--max-skipped", "1"))
    assert again["skipped"] == {} and again["forward_passes"] == 0 and again["samples_done"] == 10


def test_truncate_policy_keeps_prefix(tiny_model, tmp_path):
    conv = {"id": "long", "messages": [{"role": "user", "content": "ka lo"},
                                       {"role": "assistant", "content": "mi ne " * 200}]}
    data = write_lines(tmp_path / "data.jsonl", [json.dumps(conv)])
    out = tmp_path / "out"
    assert run_extract(tiny_model, data, out, 0, 1, "--max-length", "64", "--overlong", "truncate").returncode == 0
    (sample,) = hsextract.read_samples(out)
    assert len(sample["input_ids"]) == 64 and sample["loss_mask"][-1] == 1


def nan_model(tiny_model, tmp_path):
    """A copy of the tiny model whose embedding of one token is NaN: any sample using it has NaN states."""
    model_dir = tmp_path / "nan-model"
    shutil.copytree(tiny_model, model_dir)
    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)
    key = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors[key][NAN_TOKEN] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    return model_dir


def test_nonfinite_states_skipped_rest_of_batch_kept(tiny_model, tmp_path):
    model_dir = nan_model(tiny_model, tmp_path)
    lines = [json.dumps({"id": f"ok{i}", "input_ids": list(range(10, 40 + i)), "loss_mask": [1] * (30 + i)})
             for i in range(4)]
    lines.insert(2, json.dumps({"id": "nan", "input_ids": [11, NAN_TOKEN, 12, 13], "loss_mask": [1, 1, 1, 1]}))
    data = write_lines(tmp_path / "data.jsonl", lines)
    out = tmp_path / "out"
    proc = run_extract(model_dir, data, out, 0, 1, "--token-budget", "4096", "--max-skipped", "1")
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["skipped"] == {"nonfinite_states": 1} and summary["files"] == 1
    samples = list(hsextract.read_samples(out))
    assert sorted(s["id"] for s in samples) == ["ok0", "ok1", "ok2", "ok3"]
    assert all(torch.isfinite(s["hidden_states"]).all() for s in samples)
    assert [len(s["input_ids"]) for s in sorted(samples, key=lambda s: s["id"])] == [30, 31, 32, 33]


def test_oom_splits_batch_and_skips_only_what_cannot_fit(tiny_model, tmp_path):
    lines = [json.dumps({"id": f"s{i}", "input_ids": list(range(10, 50)), "loss_mask": [1] * 40}) for i in range(8)]
    lines.append(json.dumps({"id": "huge", "input_ids": list(range(10, 210)), "loss_mask": [1] * 200}))
    data = write_lines(tmp_path / "data.jsonl", lines)
    out = tmp_path / "out"
    proc = run_extract(tiny_model, data, out, 0, 1, "--token-budget", "4096", "--max-skipped", "1",
                       module="harness.faulty",
                       env={faulty.OOM_ABOVE_TOKENS: "100"})
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["skipped"] == {"oom": 1}
    from hsextract.output.batchfile import BatchFile

    sizes = [len(BatchFile(p)) for p in out.glob("shard-*/batch-*.safetensors")]
    assert sum(sizes) == 8 and max(sizes) == 2, f"halved until each batch fits 100 padded tokens: {sizes}"
    # skips are final unless asked: a plain re-run does nothing, --retry-skipped oom writes the sample
    assert summary_of(run_extract(tiny_model, data, out, 0, 1, "--max-skipped", "1"))["forward_passes"] == 0
    retry = summary_of(run_extract(tiny_model, data, out, 0, 1, "--retry-skipped", "oom"))
    assert retry["samples_written"] == 1 and retry["skipped"] == {}
    assert sorted(s["id"] for s in hsextract.read_samples(out)) == ["huge"] + [f"s{i}" for i in range(8)]
