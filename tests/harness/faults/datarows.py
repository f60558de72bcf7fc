"""Rows of bad input: malformed and odd dataset lines, a model dir missing a weights file, a layer out of range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    kwargs = {"max_length": 128, "long_samples": "truncate", "max_skipped": 0.2}  # (skips made on purpose)
    state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(), **kwargs)
    return case.finish(observed(state, why), None, {"hosts": case.inventory(), **kwargs},
                       case.local_out(), note="over-long one truncated to 128 tokens")


# --- the output proves what it is (issue 38) --------------------------------------------------------------------

def sealed(case: Case) -> tuple[Path, str]:
    """A clean, sealed run of the row's dataset: (its output directory, the inventory)."""
    hosts = case.inventory()
    state, _, why = case.flow(output=case.local_out(), hosts=hosts)
    assert state.is_completed(), f"the clean first run failed: {why}"
    return case.base / "out", hosts


def other_recipe(lab: Lab, case: Case) -> Outcome:
    """A sealed output extended with other layers: refused before anything runs, nothing written."""
    out, hosts = sealed(case)
    before = sorted(p.name for p in out.rglob("*"))
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts, layers="1,2")
    unchanged = sorted(p.name for p in out.rglob("*")) == before
    return case.finish(observed(state, why), seconds, {"hosts": hosts}, case.local_out(),
                       note="nothing written" if unchanged else "THE OUTPUT CHANGED")


def stale_seal(lab: Lab, case: Case) -> Outcome:
    """A batch file deleted after the seal: the next run's reconcile removes the seal before anything else."""
    out, hosts = sealed(case)
    next(out.glob("shard-*/batch-*.safetensors")).unlink()
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
    gone = not (out / "_SUCCESS").exists() and not (out / "_index.jsonl").exists()
    return case.finish(observed(state, why), seconds, {"hosts": hosts}, case.local_out(),
                       note="seal removed" if gone else "THE STALE SEAL STAYED")


def flipped_bytes(lab: Lab, case: Case) -> Outcome:
    """16 bytes flipped inside a stored batch file (its size unchanged): the readers refuse it by default, and a
    run with verify_checksums retracts it; the re-run redoes its samples."""
    import hsextract

    out, hosts = sealed(case)
    victim = next(out.glob("shard-*/batch-*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-4096:-4080] = bytes(b ^ 0xFF for b in data[-4096:-4080])
    victim.write_bytes(bytes(data))
    try:
        list(hsextract.read_samples(out))
        refused = "THE READER DELIVERED IT"
    except hsextract.CorruptOutput as exc:
        refused = "the reader refused it" if victim.name in str(exc) else f"the reader said {exc}"
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts, verify_checksums=True)
    return case.finish(observed(state, why), seconds, {"hosts": hosts}, case.local_out(), note=refused)


def stores_nothing(lab: Lab, case: Case) -> Outcome:
    """A Parquet dataset whose `messages` column holds JSON strings: every record malformed, nothing stored.
    The re-run: the same ids as proper records, with retry_skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [json.loads(line) for line in lab.data.read_text().splitlines()]
    bad = case.base / "strings.parquet"
    pq.write_table(pa.table({"id": [r["id"] for r in good], "messages": [json.dumps(r["messages"]) for r in good]}),
                   bad)
    hosts = case.inventory()
    case.data = bad
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
    case.data = lab.data
    return case.finish(observed(state, why), seconds, {"hosts": hosts, "retry_skipped": "invalid_record"},
                       case.local_out())


def degenerate_model(lab: Lab, case: Case) -> Outcome:
    """A checkpoint whose embeddings are zeroed: every captured state zero; the shard stops naming the layer.
    The re-run: the real model (the failed run stored nothing, so no recipe holds it)."""
    import torch
    from transformers import AutoModelForCausalLM

    broken = case.base / "zeroed"
    shutil.copytree(lab.model, broken)
    model = AutoModelForCausalLM.from_pretrained(broken)
    with torch.no_grad():
        model.get_input_embeddings().weight.zero_()
    model.save_pretrained(broken)
    hosts = case.inventory()
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts, model=str(broken))
    stored = list((case.base / "out").glob("shard-*/batch-*.safetensors"))
    return case.finish(observed(state, why), seconds, {"hosts": hosts}, case.local_out(),
                       note="nothing stored" if not stored else f"{len(stored)} FILE(S) STORED")


def torn_journal(lab: Lab, case: Case) -> Outcome:
    """One line torn in the middle of a shard's journal: the shard is refused naming file and line; `hsextract
    fsck --repair` cuts it, and the re-run redoes exactly its samples."""
    import subprocess
    import sys

    out, hosts = sealed(case)
    journal = next(out.glob("shard-*/journal.jsonl"))
    lines = journal.read_text().splitlines(keepends=True)
    at = next(i for i, text in enumerate(lines) if '"kind":"file"' in text)
    lines[at] = lines[at][:40] + "\n"
    journal.write_text("".join(lines))
    state, seconds, why = case.flow(output=case.local_out(), hosts=hosts)
    fsck = subprocess.run([sys.executable, "-m", "hsextract", "fsck", str(out), "--repair"], capture_output=True,
                          text=True, timeout=120)
    return case.finish(observed(state, why), seconds, {"hosts": hosts}, case.local_out(),
                       note=f"fsck --repair exit {fsck.returncode}")


def empty_dataset(lab: Lab, case: Case) -> Outcome:
    """An empty dataset: nothing to extract is no success."""
    case.data = case.base / "empty.jsonl"
    case.data.write_text("")
    state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory())
    return case.finish(observed(state, why), seconds, None, case.local_out(),
                       note="sealed" if (case.base / "out" / "_SUCCESS").exists() else "not sealed")


def huge_record(lab: Lab, case: Case) -> Outcome:
    """A 10 MB conversation among the dataset's: skipped as too long without being tokenized whole."""
    lines = lab.data.read_text().splitlines()
    huge = {"id": "huge", "messages": [{"role": "user", "content": "tell me everything"},
                                        {"role": "assistant", "content": "word " * 2_000_000}]}
    case.data = case.base / "huge.jsonl"
    case.data.write_text("\n".join([*lines[:20], json.dumps(huge), *lines[20:]]) + "\n")
    state, seconds, why = case.flow(output=case.local_out(), hosts=case.inventory(), max_skipped=0.05)
    return case.finish(observed(state, why), None, None, case.local_out())

