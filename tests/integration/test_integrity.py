"""The output proves what it is: one recipe per output, refused before a byte when a run would mix another in."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

import hsextract
from hsextract import tiny
from hsextract.output.journal import read_entries

from harness.worker import run_extract, summary_of


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tiny.build_dataset(tmp_path_factory.mktemp("integrity") / "chat.jsonl", 40, seed=3)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    """The tiny model's shapes and tokenizer, other weights."""
    return tiny.build_model(tmp_path_factory.mktemp("other") / "qwen3_5_tiny", kind="qwen3_5_text", seed=1)


@pytest.fixture(scope="module")
def extracted(tiny_model, data, tmp_path_factory):
    """`extracted(out, num_shards, shards, *args, layers=...)`: `out` made to hold those shards of the module's
    dataset as `hsextract extract` writes them. Each (shard, arguments) runs once per module and is copied from
    there: a worker writes only its shard's directory, whatever else the output holds. For a test's starting
    output; what the test itself runs stays a run of its own."""
    made: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("extracted")

    def extract_into(out: Path, num_shards: int, shards, *args: str, layers: str = "1,3,6") -> Path:
        for shard in shards:
            key = (num_shards, shard, args, layers)
            if key not in made:
                where = root / str(len(made))
                proc = run_extract(tiny_model, data, where, shard, num_shards, *args, layers=layers)
                assert proc.returncode == 0, proc.stderr
                made[key] = where
            name = f"shard-{shard:05d}-of-{num_shards:05d}"
            shutil.copytree(made[key] / name, out / name)
        return out

    return extract_into


def snapshot(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.suffix in (".jsonl", ".safetensors")}


def test_a_resume_with_other_layers_is_refused_before_a_byte(tiny_model, data, extracted, tmp_path):
    out = extracted(tmp_path / "out", 2, [0], layers="dflash:3")
    before = snapshot(out)
    recipe = next(e for e in read_entries(out / "shard-00000-of-00002" / "journal.jsonl") if e["kind"] == "recipe")
    assert recipe["recipe"]["layer_ids"] == [1, 3, 5]
    # the same shard again, and the other shard of the output, each with other layers: exit 2, nothing written
    for shard in (0, 1):
        refused = run_extract(tiny_model, data, out, shard, 2, layers="1,2")
        assert refused.returncode == 2, refused.stderr
        assert "layer_ids [1, 2] asked, [1, 3, 5] in the output" in refused.stderr
        assert recipe["fingerprint"] in refused.stderr and "new output" in refused.stderr
        assert snapshot(out) == before
        exit_record = json.loads((out / f"shard-0000{shard}-of-00002" / "exit.json").read_text())
        assert exit_record["code"] == 2 and "recipe differs" in exit_record["reason"]
    # the same recipe finishes the output; every file names it
    second = run_extract(tiny_model, data, out, 1, 2, layers="dflash:3")
    assert second.returncode == 0, second.stderr
    from safetensors import safe_open

    for path in out.glob("shard-*/batch-*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata()
        assert meta["recipe_fingerprint"] == recipe["fingerprint"]
        assert json.loads(meta["recipe"])["layer_ids"] == [1, 3, 5]
    assert {s["hidden_states"].shape[1] for s in hsextract.read_samples(out)} == {3 * 64}


def test_another_checkpoint_is_refused_and_a_copy_of_the_same_one_elsewhere_is_not(tiny_model, other_model, data,
                                                                                   extracted, tmp_path):
    out = extracted(tmp_path / "out", 2, [0])
    before = snapshot(out)
    refused = run_extract(other_model, data, out, 1, 2)
    assert refused.returncode == 2 and "weights" in refused.stderr and snapshot(out) == before, refused.stderr
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(tiny_model, copy)
    extended = run_extract(copy, data, out, 1, 2)
    assert extended.returncode == 0, extended.stderr
    assert summary_of(extended)["samples_written"] > 0


def test_the_flow_refuses_other_layers_on_a_sealed_output(prefect_server, tiny_model, data, tmp_path):
    from flows.extract import extract
    from harness.inventory import write_inventory

    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0, 1],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    kwargs = dict(model=str(tiny_model), data=str(data), output=f"file://{tmp_path / 'out'}", hosts=str(hosts),
                  heartbeat_interval_s=0.5, poll_interval_s=0.3, launch_timeout_s=30, stall_timeout_s=20,
                  host_timeout_s=10)
    state = extract(return_state=True, layers="dflash:3", run_name="recipe", **kwargs)
    assert state.is_completed(), state.message
    before = snapshot(tmp_path / "out")
    state = extract(return_state=True, layers="1,2", run_name="recipe", **kwargs)
    assert state.is_failed()
    assert "layer_ids [1, 2] asked, [1, 3, 5] in the output" in state.message and "new output" in state.message
    assert snapshot(tmp_path / "out") == before
    # refused at plan time, told as a host's failure is: the message ends where its evidence is, the artifact
    # says it is not retried, and no "Flow run encountered an exception"
    assert state.message.splitlines()[-1].startswith("evidence: artifact failure-recipe"), state.message
    assert "encountered an exception" not in state.message
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        (report,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["failure-recipe"])))
    assert "refused before anything ran" in report.data and "**not retried**" in report.data, report.data
    assert "## the run" in report.data and "layer_ids [1, 2] asked" in report.data, report.data


def test_the_flow_fails_a_worker_with_another_checkpoint_without_retrying_it(prefect_server, tiny_model, other_model,
                                                                            data, tmp_path):
    from flows.extract import extract
    from harness.inventory import write_inventory

    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    kwargs = dict(data=str(data), output=f"file://{tmp_path / 'out'}", hosts=str(hosts), layers="1,3",
                  num_shards=2, heartbeat_interval_s=0.5, poll_interval_s=0.3, launch_timeout_s=30,
                  stall_timeout_s=20, host_timeout_s=10)
    assert extract(return_state=True, model=str(tiny_model), shards=[0], run_name="a", **kwargs).is_completed()
    state = extract(return_state=True, model=str(other_model), run_name="b", **kwargs)
    assert state.is_failed()
    assert "weights" in state.message and "new output" in state.message, state.message
    assert "not retried (a re-run cannot fix this)" in state.message  # a mistake: not handed to the automation
    attempts = json.loads((tmp_path / "out" / "_runs" / "b" / "attempts.json").read_text())
    assert attempts["shard-00001-of-00002"]["failed_attempts"] == 0  # and no attempt counted


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_stale_seal_is_removed_first_and_a_repaired_output_sealed_anew(tiny_model, data, extracted, tmp_path,
                                                                        damage):
    from hsextract.store import LocalStore
    from tasks.reconcile import INDEX_NAME, SUCCESS_NAME, dataset_ids, reconcile_output

    out = extracted(tmp_path / "out", 2, [0, 1], "--token-budget", "256")
    first = reconcile_output(LocalStore(out), dataset_ids(data), 2)
    assert first.sealed and first.generation == 1 and first.fingerprint
    seal = json.loads((out / SUCCESS_NAME).read_text())
    assert seal["fingerprint"] == first.fingerprint and seal["generation"] == 1 and len(seal["index_sha256"]) == 64
    victim = sorted(out.glob("shard-00001-of-00002/batch-*.safetensors"))[0]
    if damage == "deleted":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:1000])
    found = reconcile_output(LocalStore(out), dataset_ids(data), 2, retract=True)
    assert not found.complete and found.unsealed and not found.sealed and not found.already_sealed
    assert not (out / SUCCESS_NAME).exists() and not (out / INDEX_NAME).exists()
    assert "stale _SUCCESS removed" in found.markdown()
    rerun = run_extract(tiny_model, data, out, 1, 2, "--token-budget", "256")
    assert rerun.returncode == 0, rerun.stderr
    healed = reconcile_output(LocalStore(out), dataset_ids(data), 2)
    assert healed.sealed and healed.generation == 2
    named = {json.loads(line)["file"] for line in (out / INDEX_NAME).read_text().splitlines()}
    assert all((out / key).is_file() for key in named) and f"shard-00001-of-00002/{victim.name}" not in named
    again = reconcile_output(LocalStore(out), dataset_ids(data), 2)
    assert again.already_sealed and again.generation == 2 and not again.sealed


def flip(path: Path, offset_from_end: int = 4096, count: int = 16) -> None:
    """`count` bytes inside the file's data inverted in place (its size unchanged)."""
    data = bytearray(path.read_bytes())
    at = len(data) - offset_from_end
    data[at:at + count] = bytes(b ^ 0xFF for b in data[at:at + count])
    path.write_bytes(bytes(data))


def test_flipped_or_truncated_bytes_are_refused_by_every_default_reader(tiny_model, data, tmp_path, monkeypatch):
    import subprocess

    from hsextract.errors import CorruptOutput
    from hsextract.training import reader
    from hsextract.training.reader import HiddenStatesDataset
    from hsextract.training.stream import HiddenStatesStream

    out = tmp_path / "out"
    assert run_extract(tiny_model, data, out, 0, 1, "--token-budget", "256").returncode == 0
    victim = sorted(out.glob("shard-*/batch-*.safetensors"))[1]
    good = victim.read_bytes()
    # a stream hashes each file the first time it reads it, and again only once the file changed
    modes, real = [], reader.check_bytes
    monkeypatch.setattr(reader, "check_bytes", lambda data, entry, where, mode, repair="": (
        modes.append((Path(where).name, mode)), real(data, entry, where, mode, repair)))
    stream, files = HiddenStatesStream(out), len(list(out.glob("shard-*/batch-*.safetensors")))
    first = [s["id"] for s in stream]
    assert sorted(modes) == sorted((p.name, "fast") for p in out.glob("shard-*/batch-*.safetensors"))
    modes.clear()
    assert [s["id"] for s in stream] == first and [m for _, m in modes] == ["off"] * files
    flip(victim)
    with pytest.raises(CorruptOutput, match=victim.name):
        list(stream)
    monkeypatch.undo()
    for damage in ("flipped", "truncated"):
        victim.write_bytes(good)
        flip(victim) if damage == "flipped" else victim.write_bytes(good[:-100])
        readers = {"read_samples": lambda: list(hsextract.read_samples(out)),
                   "HiddenStatesStream": lambda: list(HiddenStatesStream(out)),
                   "HiddenStatesDataset": lambda: [d[i] for d in [HiddenStatesDataset(out)] for i in range(len(d))]}
        for name, read in readers.items():
            with pytest.raises(CorruptOutput) as caught:
                read()
            text = str(caught.value)
            assert victim.name in text and "shard-00000-of-00001" in text and "fsck" in text, (name, text)
            assert ("truncated" in text) if damage == "truncated" else ("xxh3" in text and "changed" in text)
        exported = subprocess.run([sys.executable, "-m", "hsextract", "export", str(out), str(tmp_path / damage),
                                   "--format", "specforge-dflash"], capture_output=True, text=True, timeout=300)
        assert exported.returncode == 2 and victim.name in exported.stderr, exported.stderr
        # a batch file read alone checks its data against its own header
        if damage == "flipped":
            with pytest.raises(CorruptOutput, match="its header recorded"):
                list(hsextract.read_samples(victim))
    victim.write_bytes(good)
    assert len(list(hsextract.read_samples(out))) == len(list(hsextract.read_samples(out, verify=False)))


def test_export_refuses_a_partial_output_or_a_destination_inside_it(tiny_model, data, extracted, tmp_path):
    import subprocess

    out = extracted(tmp_path / "out", 2, [0])  # shard 1 of 2 never ran

    def export(dest, *extra):
        return subprocess.run([sys.executable, "-m", "hsextract", "export", str(out), str(dest), "--format",
                               "specforge-dflash", *extra], capture_output=True, text=True, timeout=300)

    refused = export(tmp_path / "e")
    assert refused.returncode == 2 and "shard-00001-of-00002" in refused.stderr and "--allow-partial" in refused.stderr
    assert not (tmp_path / "e").exists()
    inside = export(out / "e", "--allow-partial")
    assert inside.returncode == 2 and "inside the source" in inside.stderr and not (out / "e").exists()
    partial = export(tmp_path / "p", "--allow-partial")
    assert partial.returncode == 0 and "PARTIAL" in partial.stdout, partial.stderr
    summary = json.loads((tmp_path / "p" / "export.json").read_text())
    assert summary["shards_not_done"] == ["shard-00001-of-00002"] and summary["recipe"]["layer_ids"] == [1, 3, 6]
    assert summary["recipe_fingerprint"] == summary["recipe"]["fingerprint"]
    assert run_extract(tiny_model, data, out, 1, 2).returncode == 0  # complete: every shard done
    whole = export(tmp_path / "w")
    assert whole.returncode == 0 and "PARTIAL" not in whole.stdout, whole.stderr


def test_a_run_that_stores_nothing_or_skips_too_much_fails_naming_why(tiny_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.worker import dataset_ids as ids_of  # noqa: F401 - (the same helper module)

    rows = [tiny.make_conversation(__import__("random").Random(i), f"s{i}", 1, 8) for i in range(12)]
    # a Parquet file whose `messages` column holds JSON strings, not lists: every record is malformed
    table = pa.table({"id": [r["id"] for r in rows], "messages": [json.dumps(r["messages"]) for r in rows]})
    pq.write_table(table, tmp_path / "strings.parquet")
    out = tmp_path / "out"
    failed = run_extract(tiny_model, tmp_path / "strings.parquet", out, 0, 1)
    assert failed.returncode == 2, failed.stderr
    assert "stored none of its 12 sample(s): invalid_record x12 (e.g. line 1:" in failed.stderr
    assert "--retry-skipped invalid_record" in failed.stderr
    assert not any(e["kind"] == "done" for e in read_entries(out / "shard-00000-of-00001" / "journal.jsonl"))
    # over the threshold: 2 of 12 records broken is 16.7% > 1%; --max-skipped 0.2 lets it through
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows[:10]) + '{"id": "x", "messages": "no"}\n{oops\n')
    over = run_extract(tiny_model, mixed, tmp_path / "o2", 0, 1)
    assert over.returncode == 2 and "skipped 2 of its 12 sample(s) (16.7%, over --max-skipped 0.01)" in over.stderr and "line 12" in over.stderr
    assert run_extract(tiny_model, mixed, tmp_path / "o3", 0, 1, "--max-skipped", "0.2").returncode == 0


def test_the_preflight_check_fails_on_a_dataset_it_would_skip(tiny_model, tmp_path):
    import subprocess

    rows = [tiny.make_conversation(__import__("random").Random(i), f"s{i}", 1, 8) for i in range(10)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"id": r["id"], "messages": json.dumps(r["messages"])}) + "\n" for r in rows))
    check = subprocess.run([sys.executable, "-m", "hsextract", "check", "--model", str(tiny_model), "--data", str(bad),
                            "--out", str(tmp_path / "o"), "--layers", "1", "--shard", "0", "--num-shards", "1",
                            "--sample-tokens", "10"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 2 and "10 of the 10 record(s) sampled are malformed" in check.stderr, check.stderr
    assert "must be a list" in check.stderr


def test_the_flow_fails_an_empty_dataset(prefect_server, tiny_model, tmp_path):
    from flows.extract import extract
    from harness.inventory import write_inventory

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    state = extract(return_state=True, model=str(tiny_model), data=str(empty), output=f"file://{tmp_path / 'out'}",
                    hosts=str(hosts), layers="1,3", heartbeat_interval_s=0.5, poll_interval_s=0.3,
                    launch_timeout_s=30, stall_timeout_s=20, host_timeout_s=10)
    assert state.is_failed() and "the dataset has no samples" in state.message, state.message
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def fsck_cli(out, *extra):
    import subprocess

    return subprocess.run([sys.executable, "-m", "hsextract", "fsck", str(out), *extra], capture_output=True,
                          text=True, timeout=300)


def test_fsck_lists_every_problem_and_repair_loses_no_good_sample(tiny_model, data, extracted, tmp_path):
    from collections import Counter

    from hsextract.store import LocalStore
    from tasks.reconcile import SUCCESS_NAME, dataset_ids, reconcile_output

    out = extracted(tmp_path / "out", 2, [0, 1], "--token-budget", "256")
    assert reconcile_output(LocalStore(out), dataset_ids(data), 2).sealed
    clean = fsck_cli(out, "--verify")
    assert clean.returncode == 0 and "clean" in clean.stdout, clean.stdout + clean.stderr
    s0, s1 = out / "shard-00000-of-00002", out / "shard-00001-of-00002"
    files0, files1 = sorted(s0.glob("batch-*.safetensors")), sorted(s1.glob("batch-*.safetensors"))
    files0[0].unlink()                                            # missing
    flip(files0[1])                                               # corrupt, same size (found by --verify)
    files1[0].write_bytes(files1[0].read_bytes()[:500])           # truncated
    (s1 / "batch-000099.safetensors").write_bytes(b"never journaled")
    (s1 / ".batch-000100.safetensors.tmp").write_bytes(b"half")
    journal = s1 / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    torn_at = next(i for i, text in enumerate(lines) if '"kind":"file"' in text and files1[0].name not in text)
    torn_ids = json.loads(lines[torn_at])["ids"]
    lines[torn_at] = lines[torn_at][:40] + "\n"                   # a torn line in the middle
    journal.write_text("".join(lines))
    refused = run_extract(tiny_model, data, out, 1, 2, "--token-budget", "256")
    assert refused.returncode != 0 and "corrupt journal line" in refused.stderr  # the shard is blocked, named

    found = fsck_cli(out, "--verify")
    assert found.returncode == 1, found.stdout + found.stderr
    said = found.stdout
    for expected in (f"{files0[0].name}: journaled, but not there", f"{files0[1].name}: checksum mismatch, xxh3",
                     f"{files1[0].name}: 500 bytes", "batch-000099.safetensors: a batch file no journal names",
                     ".batch-000100.safetensors.tmp: a temp file", f"journal.jsonl:{torn_at + 1}: line does not parse",
                     f"{SUCCESS_NAME}: the output is sealed, and the seal does not hold"):
        assert expected in said, (expected, said)
    repaired = fsck_cli(out, "--repair", "--verify")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "REPAIRED" in repaired.stdout and not (out / SUCCESS_NAME).exists()
    # the torn line cut; a `lost` entry for the truncated file, and one that reopens the shard, added
    assert (s1 / "journal.jsonl").read_text().count("\n") == len(lines) + 1
    assert list(s1.glob("journal.jsonl.fsck-*")) and not (s1 / "batch-000099.safetensors").exists()
    for shard in range(2):  # the next runs redo exactly what was lost
        rerun = run_extract(tiny_model, data, out, shard, 2, "--token-budget", "256")
        assert rerun.returncode == 0, rerun.stderr
        assert summary_of(rerun)["samples_written"] > 0
    assert set(torn_ids) <= {s["id"] for s in hsextract.read_samples(out)}
    assert fsck_cli(out, "--verify").returncode == 0
    report = reconcile_output(LocalStore(out), dataset_ids(data), 2)
    assert report.sealed and report.duplicated == 0
    assert Counter(s["id"] for s in hsextract.read_samples(out)) == Counter(
        {i: 1 for i in set(json.loads(x)["id"] for x in data.read_text().splitlines())} )


def test_fsck_names_mixed_recipes_and_an_unreadable_output(tiny_model, data, tmp_path):
    out = tmp_path / "out"
    assert run_extract(tiny_model, data, out, 0, 2, layers="1,3").returncode == 0
    other = tmp_path / "other"
    assert run_extract(tiny_model, data, other, 1, 2, layers="1,2").returncode == 0
    shutil.copytree(other / "shard-00001-of-00002", out / "shard-00001-of-00002")  # a copy made by hand
    found = fsck_cli(out)
    assert found.returncode == 1 and "mixed recipes" in found.stdout and "shard-00001-of-00002" in found.stdout
    assert fsck_cli(out, "--repair").returncode == 1  # not repaired: which recipe to keep is a person's call
    from hsextract.errors import CorruptOutput

    with pytest.raises(CorruptOutput, match="holds 2 recipes"):
        next(hsextract.read_samples(out))
    missing = fsck_cli(tmp_path / "nothing")
    assert missing.returncode == 2 and "cannot read it" in missing.stderr


def test_an_s3_output_without_credentials_fails_naming_aws_credentials(prefect_server, tiny_model, data, tmp_path,
                                                                        monkeypatch):
    from flows.extract import extract
    from harness.inventory import write_inventory

    import boto3

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # a session of an earlier test keeps the keys it found
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    state = extract(return_state=True, model=str(tiny_model), data=str(data), output="s3://nobody/run",
                    hosts=str(hosts), layers="1,3")
    assert state.is_failed()
    assert "no AWS credentials" in state.message and "aws_credentials" in state.message, state.message
    assert not (tmp_path / "w").exists()  # refused before any host was touched


def test_a_checkpoint_made_degenerate_fails_naming_the_layer_and_stores_nothing(tiny_model, data, extracted,
                                                                                tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    broken = tmp_path / "zeroed"
    shutil.copytree(tiny_model, broken)
    model = AutoModelForCausalLM.from_pretrained(broken)
    with torch.no_grad():
        model.get_input_embeddings().weight.zero_()  # every state after it is zero: what a broken kernel gives
    model.save_pretrained(broken)
    out = tmp_path / "out"
    failed = run_extract(broken, data, out, 0, 1)
    assert failed.returncode == 2, failed.stderr
    assert "layer 1's states are all zeros for every one of the" in failed.stderr and "broken" in failed.stderr
    assert not list(out.glob("shard-*/batch-*.safetensors"))
    assert not [e for e in read_entries(out / "shard-00000-of-00001" / "journal.jsonl") if e["kind"] == "file"]
    # a sound model: every file journals its layers' RMS, and the heartbeat the run's
    extracted(tmp_path / "good", 1, [0])
    files = [e for e in read_entries(tmp_path / "good" / "shard-00000-of-00001" / "journal.jsonl")
             if e["kind"] == "file"]
    assert files and all(len(e["rms"]) == 3 and all(r > 0 for r in e["rms"]) for e in files)
    beat = json.loads((tmp_path / "good" / "shard-00000-of-00001" / "heartbeat.json").read_text())
    assert len(beat["layer_rms"]) == 3 and all(r > 0 for r in beat["layer_rms"])


def test_a_huge_record_is_never_tokenized_whole(tiny_model, tmp_path):
    import random

    rows = [tiny.make_conversation(random.Random(i), f"s{i:03d}", 1, 8) for i in range(30)]
    huge = {"id": "huge", "messages": [{"role": "user", "content": "tell me everything"},
                                        {"role": "assistant", "content": "word " * 2_000_000}]}  # 10 MB of text
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:15] + [huge] + rows[15:]))
    skipped = run_extract(tiny_model, data, tmp_path / "skip", 0, 1, "--max-skipped", "0.05")
    assert skipped.returncode == 0, skipped.stderr
    entry = next(e for e in read_entries(tmp_path / "skip" / "shard-00000-of-00001" / "journal.jsonl")
                 if e.get("id") == "huge")
    assert entry["reason"] == "too_long" and "bytes of text, over 131072 (--max-length 8192 x 16)" in entry["detail"]
    assert summary_of(skipped)["samples_written"] == 30
    cut = run_extract(tiny_model, data, tmp_path / "cut", 0, 1, "--max-length", "512", "--overlong", "truncate")
    assert cut.returncode == 0, cut.stderr
    stored = {s["id"]: s for s in hsextract.read_samples(tmp_path / "cut")}
    assert stored["huge"]["input_ids"].shape[0] == 512 and len(stored) == 31


def test_a_dataset_whose_records_changed_under_their_ids_is_refused(tiny_model, data, extracted, tmp_path):
    out = extracted(tmp_path / "out", 1, [0])
    files = [e for e in read_entries(out / "shard-00000-of-00001" / "journal.jsonl") if e["kind"] == "file"]
    assert all(len(e["tokens_xxh3"]) == len(e["records_xxh3"]) == len(e["ids"]) for e in files)
    import array

    import xxhash

    for sample in hsextract.read_samples(out):  # a trainer can tell that states and tokens belong together
        entry = next(e for e in files if sample["id"] in e["ids"])
        want = entry["tokens_xxh3"][entry["ids"].index(sample["id"])]
        assert xxhash.xxh3_64(array.array("i", sample["input_ids"].tolist()).tobytes()).hexdigest() == want
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[5]["messages"][-1]["content"] += " and something else"  # another dataset reusing the ids
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = snapshot(out)
    refused = run_extract(tiny_model, other, out, 0, 1)
    assert refused.returncode == 2 and f"{rows[5]['id']} (line 6)" in refused.stderr, refused.stderr
    assert "new output" in refused.stderr and snapshot(out) == before
    # reconcile tells it too: by content with the full check, by ids alone (the default) it cannot
    from hsextract.data.records import iter_digests
    from hsextract.store import LocalStore
    from tasks.reconcile import SUCCESS_NAME, UNSEALED_NAME, dataset_ids, reconcile_output

    assert reconcile_output(LocalStore(out), dataset_ids(other), 1).sealed
    found = reconcile_output(LocalStore(out), iter_digests(other), 1, verify=True)
    assert found.changed_ids == [rows[5]["id"]] and not found.complete and found.unsealed and found.missing == 0
    assert not (out / SUCCESS_NAME).exists() and "1 record(s) changed" in (out / UNSEALED_NAME).read_text()
    assert "Changed records** (1)" in found.markdown() and found.summary()["changed"] == 1
    assert reconcile_output(LocalStore(out), iter_digests(data), 1, verify=True).sealed  # its own dataset: sealed


def test_the_flow_fails_a_complete_output_whose_dataset_changed_under_its_ids(prefect_server, tiny_model, data,
                                                                               extracted, tmp_path):
    """Every shard already complete: no worker runs to notice; the flow's full reconcile does."""
    from flows.extract import extract
    from harness.inventory import write_inventory

    out = extracted(tmp_path / "out", 2, [0, 1], layers="dflash:3")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[7]["messages"][0]["content"] = "another question"
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hosts = write_inventory(tmp_path / "hosts.yaml", [{"name": "local", "hostname": "local", "gpus": [0],
                                                       "workdir": str(tmp_path / "w"), "python": sys.executable}])
    state = extract(return_state=True, model=str(tiny_model), data=str(other), output=f"file://{out}",
                    hosts=str(hosts), num_shards=2, layers="dflash:3", verify_checksums=True,
                    heartbeat_interval_s=0.5, poll_interval_s=0.3, launch_timeout_s=30, stall_timeout_s=20,
                    host_timeout_s=10)
    assert state.is_failed(), state.message
    assert f"1 record(s) of {other} are not the records" in state.message and rows[7]["id"] in state.message
    assert "new output" in state.message and not (out / "_SUCCESS").exists()
