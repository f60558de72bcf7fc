"""`hsextract export` loaded by the trainers' own code (SpecForge 0.2.0, speculators 0.9.0, in a venv of
their own: harness.trainers), compared with the extraction (read_samples) and with an independent per-sample
transformers reference (forward hooks for the layers' outputs, the model's norm for the final state)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsextract import read_samples, tiny
from harness.trainers import load_with_trainer
from harness.worker import run_extract

MAX_LEN = 64  # the trainer's max length: the export cuts samples to it, then judges them
LAYERS = [1, 3, 4, 7]  # eagle3+last of the 8-layer tiny model: eagle3 = 1, 3, 4 and the last layer, 7
#: pre-tokenized samples the worker keeps (two supervised tokens in a row) that some trainer rejects once cut
CRAFTED = {
    "late": [0] * 70 + [1] * 10,                # nothing supervised in the first 64 tokens
    "pair-at-63": [0] * 63 + [1, 1] + [0] * 15,  # one supervised token left, the 64th: DFlash and EAGLE-3 refuse
    "pair-at-62": [0] * 62 + [1, 1] + [0] * 16,  # two left: every trainer takes it
}
REJECTED = {"specforge-dflash": {"late": "fewer than 2 consecutive supervised tokens",
                                 "pair-at-63": "fewer than 2 consecutive supervised tokens"},
            "specforge-eagle3": {"late": "no supervised token before the last",
                                 "pair-at-63": "no supervised token before the last"},
            "speculators": {"late": "no supervised token after the first"}}


def export_cli(src, dest, fmt, *extra, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsextract", "export", str(src), str(dest), "--format", fmt,
                           *extra], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tiny.build_dataset(tmp_path_factory.mktemp("export-data") / "mixed.jsonl", 16, seed=7)
    rng = random.Random(3)
    with path.open("a") as f:
        for sample_id, mask in CRAFTED.items():
            f.write(json.dumps({"id": sample_id, "input_ids": [rng.randrange(5, 60) for _ in mask],
                                "loss_mask": mask}) + "\n")
    return path


@pytest.fixture(scope="module")
def extracted(tiny_model, data, tmp_path_factory) -> Path:
    """Two shards of eagle3+last with the final normed state, fp32 on CPU."""
    out = tmp_path_factory.mktemp("export-src") / "out"
    for shard in range(2):
        proc = run_extract(tiny_model, data, out, shard, 2, "--include-last", "--dtype", "float32",
                           "--token-budget", "512", layers="eagle3+last")
        assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def reference(tiny_model, extracted) -> dict:
    """Per sample, alone: each decoder layer's output (forward hooks) and the model's norm of the last one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    decoder = next(m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)
                   and hasattr(m, "norm"))
    outputs: dict[int, torch.Tensor] = {}
    for k, layer in enumerate(decoder.layers):
        layer.register_forward_hook(lambda _m, _i, out, k=k: outputs.__setitem__(
            k, (out[0] if isinstance(out, tuple) else out)[0].clone()))
    found = {}
    with torch.no_grad():
        for sample in read_samples(extracted):
            model(input_ids=sample["input_ids"].long()[None], use_cache=False)
            found[sample["id"]] = {"input_ids": sample["input_ids"].long(), "loss_mask": sample["loss_mask"].long(),
                                   "layers": dict(outputs), "normed": decoder.norm(outputs[7][None])[0]}
    return found


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    error = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
    assert error < 1e-5, f"{what}: relative error {error:.2e}"


def rows_of(dest: Path) -> list[str]:
    """The sample id of each exported row, in row order (index.jsonl)."""
    entries = [json.loads(line) for line in (dest / "index.jsonl").read_text().splitlines()]
    rows = [e for e in entries if "row" in e]
    assert [e["row"] for e in rows] == list(range(len(rows)))
    return [e["id"] for e in rows]


@pytest.mark.parametrize("fmt", ["specforge-dflash", "specforge-eagle3", "speculators"])
def test_the_trainers_own_loaders_read_every_good_sample_once_equal_to_the_reference(
        fmt, extracted, reference, tiny_model, tmp_path):
    dest = tmp_path / fmt
    proc = export_cli(extracted, dest, fmt, "--max-length", str(MAX_LEN))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((dest / "export.json").read_text())
    rejected = REJECTED[fmt]
    assert summary["complete"] and summary["samples_in_src"] == len(reference)
    assert summary["exported"] == len(reference) - len(rejected)
    assert {why: n for why, n in summary["skipped"].items()} == {
        why: sum(1 for w in rejected.values() if w == why) for why in set(rejected.values())}
    assert sorted(i for ids in summary["skipped_examples"].values() for i in ids) == sorted(rejected)
    assert f"exported {summary['exported']} of {len(reference)} sample(s)" in proc.stdout
    ids = rows_of(dest)
    assert sorted(ids) == sorted(set(reference) - set(rejected)), "every good sample exactly once"
    src_order = [s["id"] for s in read_samples(extracted) if s["id"] not in rejected]
    assert ids == src_order, "in the source's reading order"

    extra = ("--train-step", str(tiny_model), "--target-layer-ids",
             ",".join(map(str, summary["trainer_layer_ids"]))) if fmt == "speculators" else ()
    loaded_path = tmp_path / "loaded.pt"
    report = json.loads(load_with_trainer(fmt, dest, loaded_path, MAX_LEN, *extra).stdout.splitlines()[-1])
    loaded = torch.load(loaded_path, weights_only=False)
    assert report["samples"] == len(loaded) == len(ids)
    ours = {s["id"]: s for s in read_samples(extracted)}
    cut = 0
    for n, (sample_id, got) in enumerate(zip(ids, loaded)):
        ref = {k: v[:MAX_LEN] if torch.is_tensor(v) else {i: t[:MAX_LEN] for i, t in v.items()}
               for k, v in reference[sample_id].items()}
        mine = {k: v[:MAX_LEN] for k, v in ours[sample_id].items() if torch.is_tensor(v)}
        cut += reference[sample_id]["input_ids"].shape[0] > MAX_LEN
        what = f"{fmt} row {n} ({sample_id})"
        assert torch.equal(got["input_ids"], ref["input_ids"]), what
        if fmt == "specforge-dflash":
            assert got["file"].endswith(f"{n:09d}.ckpt"), got["file"]
            assert torch.equal(got["loss_mask"], ref["loss_mask"]), what
            assert torch.equal(got["hidden_states"], mine["hidden_states"]), f"{what}: not the extraction's states"
            close(got["hidden_states"], torch.cat([ref["layers"][k] for k in LAYERS], -1), what)
        elif fmt == "specforge-eagle3":
            want_mask = ref["loss_mask"].clone()
            want_mask[-1] = 0  # SpecForge's EAGLE-3 reader does this itself
            assert torch.equal(got["loss_mask"], want_mask), what
            # its normalizer hands the aux layers over as `hidden_state` and the stored final state as `target`
            close(got["target"], ref["normed"], f"{what}: target (the final state, after the norm)")
            close(got["hidden_state"], torch.cat([ref["layers"][k] for k in (1, 3, 4)], -1), f"{what}: aux")
        else:
            assert torch.equal(got["loss_mask"], ref["loss_mask"]), what
            close(got["hidden_states"], torch.cat([ref["layers"][k] for k in (1, 3, 4)], -1), f"{what}: aux")
            close(got["verifier_last_hidden_states"], ref["layers"][7], f"{what}: verifier slot (before the norm)")
    assert cut >= 3, "samples longer than the max length were cut, not only the crafted ones"
    if fmt == "speculators":
        assert summary["trainer_layer_ids"] == [2, 4, 5], "speculators numbers the stream entering a layer"
        losses = report["losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1], losses
        freq = torch.load(dest / "token_freq.pt", weights_only=True)
        supervised = torch.cat([reference[i]["input_ids"][:MAX_LEN][reference[i]["loss_mask"][:MAX_LEN].bool()]
                                for i in ids])
        assert freq == dict(zip(*[t.tolist() for t in supervised.unique(return_counts=True)]))
    else:
        assert summary["trainer_layer_ids"] == (LAYERS if fmt == "specforge-dflash" else [1, 3, 4])


def test_an_interrupted_export_continues_to_the_same_result(extracted, tmp_path):
    """The state a kill leaves: rows 0-4 indexed, row 5's line cut short, row 5's file written (garbage), no
    Arrow dataset yet. Run again: the same export as one that was never interrupted."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert export_cli(extracted, whole, "speculators").returncode == 0
    shutil.copytree(whole, cut)
    lines = (cut / "index.jsonl").read_text().splitlines(keepends=True)
    (cut / "index.jsonl").write_text("".join(lines[:5]) + lines[5][:7])
    for name in ("dataset_info.json", "state.json", "token_freq.pt", *[p.name for p in cut.glob("*.arrow")]):
        (cut / name).unlink()
    for path in sorted((cut / "hidden_states").glob("*.safetensors")):
        if int(path.stem.removeprefix("hs_")) >= 6:
            path.unlink()
    (cut / "hidden_states" / "hs_5.safetensors").write_bytes(b"half a file")
    summary = json.loads((cut / "export.json").read_text())
    (cut / "export.json").write_text(json.dumps({k: summary[k] for k in ("format", "src", "max_length",
                                                                       "recipe_fingerprint")} | {"complete": False}))
    proc = export_cli(extracted, cut, "speculators")
    assert proc.returncode == 0, proc.stderr
    same_export(cut, whole)
    again = export_cli(extracted, cut, "speculators")  # a complete export: nothing to do, same summary
    assert again.returncode == 0 and "exported" in again.stdout


def test_an_export_killed_after_its_last_row_finishes_the_same(extracted, tmp_path):
    """The state a kill in the last step leaves: every row indexed and written, no Arrow dataset, no scratch
    directory, the summary not complete. Run again: nothing to write, the dataset made, the same export."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert export_cli(extracted, whole, "speculators").returncode == 0
    shutil.copytree(whole, cut)
    for name in ("dataset_info.json", "state.json", "token_freq.pt", *[p.name for p in cut.glob("*.arrow")]):
        (cut / name).unlink()
    summary = json.loads((cut / "export.json").read_text())
    (cut / "export.json").write_text(json.dumps({k: summary[k] for k in ("format", "src", "max_length",
                                                                       "recipe_fingerprint")} | {"complete": False}))
    assert not (cut / ".partial").exists()
    proc = export_cli(extracted, cut, "speculators")
    assert proc.returncode == 0, proc.stderr
    same_export(cut, whole)


def test_an_export_killed_again_and_again_ends_as_one_never_killed(extracted, tmp_path):
    """SIGKILL at several points of a real export (once the index holds 2, 6, then 12 lines), each run
    continuing the last: the result is the uninterrupted export's."""
    import signal

    whole, dest = tmp_path / "whole", tmp_path / "killed"
    assert export_cli(extracted, whole, "speculators").returncode == 0
    killed = []
    for at in (2, 6, 12):
        proc = subprocess.Popen([sys.executable, "-m", "hsextract", "export", str(extracted), str(dest), "--format",
                                 "speculators"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        index = dest / "index.jsonl"
        while proc.poll() is None:
            if index.exists() and index.read_bytes().count(b"\n") >= at:
                proc.kill()
                break
        killed.append(proc.wait() == -signal.SIGKILL and not json.loads((dest / "export.json").read_text())["complete"])
    assert sum(killed) >= 2, f"killed mid-export: {killed}"
    proc = export_cli(extracted, dest, "speculators")
    assert proc.returncode == 0, proc.stderr
    same_export(dest, whole)


def same_export(got: Path, want: Path) -> None:
    """Two speculators exports hold the same rows, files, Arrow dataset and token frequencies."""
    import datasets
    from safetensors.torch import load_file

    assert (got / "index.jsonl").read_text() == (want / "index.jsonl").read_text()
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir()), "no scratch left"
    assert sorted(p.name for p in (got / "hidden_states").iterdir()) == \
        sorted(p.name for p in (want / "hidden_states").iterdir()), "no file left over from a killed run"
    for path in sorted((want / "hidden_states").glob("*.safetensors")):
        again = load_file(got / "hidden_states" / path.name)
        assert all(torch.equal(t, again[k]) for k, t in load_file(path).items()), path.name
    a, b = datasets.load_from_disk(str(want)), datasets.load_from_disk(str(got))
    assert a.to_dict() == b.to_dict() and len(a) == len(rows_of(want))
    assert torch.load(got / "token_freq.pt") == torch.load(want / "token_freq.pt")


def test_what_cannot_be_exported_is_refused_before_writing(tiny_model, data, extracted, tmp_path):
    plain = tmp_path / "plain"
    assert run_extract(tiny_model, data, plain, 0, 4, "--dtype", "float32", layers="1,3").returncode == 0
    for fmt, says in (("speculators", "extract with --layers eagle3+last"),
                      ("specforge-eagle3", "extract with --include-last")):
        proc = export_cli(plain, tmp_path / fmt, fmt, "--allow-partial")  # (shards 1-3 never ran)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert not (tmp_path / fmt).exists(), "nothing written"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    proc = export_cli(extracted, busy, "specforge-dflash")
    assert proc.returncode == 2 and "not empty and not an hsextract export" in proc.stderr
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    done = tmp_path / "done"
    assert export_cli(extracted, done, "specforge-dflash").returncode == 0
    proc = export_cli(extracted, done, "speculators")
    assert proc.returncode == 2 and "other settings (format: 'specforge-dflash', not 'speculators')" in proc.stderr


def test_an_s3_output_exports_and_streams(tiny_model, data, s3, s3_endpoint, tmp_path, monkeypatch):
    client, bucket = s3
    for shard in range(2):
        proc = run_extract(tiny_model, data, f"s3://{bucket}/run", shard, 2, "--dtype", "float32", "--spool",
                           str(tmp_path / "spool"), "--s3-endpoint", s3_endpoint, layers="dflash:3")
        assert proc.returncode == 0, proc.stderr
    dest = tmp_path / "dflash"
    proc = export_cli(f"s3://{bucket}/run", dest, "specforge-dflash", env={"AWS_ENDPOINT_URL": s3_endpoint})
    assert proc.returncode == 0, proc.stderr
    want = {s["id"]: s for s in read_samples(f"s3://{bucket}/run", client=client)}
    ids = rows_of(dest)
    assert sorted(ids) == sorted(want), "nothing cut: every sample exported"
    for n, sample_id in enumerate(ids):
        record = torch.load(dest / f"{n // 10000:05d}" / f"{n:09d}.ckpt", weights_only=True)
        assert torch.equal(record["hidden_states"], want[sample_id]["hidden_states"]), sample_id
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # the stream's readers make their own S3 clients
    per_rank = stream_records(f"s3://{bucket}/run", 2, 1, keys="specforge-dflash", shuffle=True)
    assert sorted(r["id"] for records in per_rank for r in records) == sorted(want)
    for records in per_rank:  # downloaded into shared memory in the worker, mapped here
        for record in records:
            assert torch.equal(record["hidden_states"], want[record["id"]]["hidden_states"]), record["id"]
            assert torch.equal(record["input_ids"], want[record["id"]]["input_ids"].long()), record["id"]


def stream_ids(source, world_size: int, workers: int, **kwargs) -> list[list[str]]:
    """The ids each rank's DataLoader (with `workers` worker processes) yields, one list per rank."""
    return [[s["id"] for s in records] for records in stream_records(source, world_size, workers, **kwargs)]


def stream_records(source, world_size: int, workers: int, **kwargs) -> list[list[dict]]:
    """The records each rank's DataLoader (with `workers` worker processes) yields, one list per rank."""
    from hsextract import HiddenStatesStream

    got = []
    for rank in range(world_size):
        stream = HiddenStatesStream(source, rank=rank, world_size=world_size, **kwargs)
        got.append(list(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)))
    return got


def same_records(got: list[dict], want: list[dict], where: str) -> None:
    """Records that crossed from DataLoader workers equal those read in this process, key by key."""
    assert [r["id"] for r in got] == [r["id"] for r in want], where
    for a, b in zip(got, want):
        assert a.keys() == b.keys(), (where, a["id"])
        for key, value in b.items():
            same = (torch.equal(a[key], value) and a[key].dtype == value.dtype and type(a[key]) is torch.Tensor
                    if torch.is_tensor(value) else a[key] == value)
            assert same, (where, a["id"], key)


def test_the_stream_gives_every_sample_once_per_epoch_across_ranks_and_workers(extracted, reference):
    from hsextract import HiddenStatesStream

    every = sorted(reference)
    for world_size, workers in ((1, 0), (2, 2), (3, 1)):
        per_rank = stream_ids(extracted, world_size, workers)
        flat = [i for ids in per_rank for i in ids]
        assert sorted(flat) == every, f"{world_size} rank(s) x {workers} worker(s): each sample exactly once"
        assert all(per_rank), "every rank got samples"
    stream = HiddenStatesStream(extracted, shuffle=True, seed=5, rank=0, world_size=1)
    first = [s["id"] for s in stream]
    stream.set_epoch(1)
    second = [s["id"] for s in stream]
    assert sorted(first) == sorted(second) == every and first != second, "another order, the same samples"
    stream.set_epoch(0)
    assert [s["id"] for s in stream] == first, "an epoch's order is fixed by seed and epoch"
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1, persistent_workers=True)
    for epoch, expected in ((0, first), (1, second), (0, first)):
        stream.set_epoch(epoch)
        assert [s["id"] for s in loader] == expected, f"epoch {epoch} in a persistent DataLoader worker"


@pytest.mark.parametrize("fmt", ["specforge-dflash", "speculators"])
def test_the_stream_yields_what_the_export_would_in_the_trainers_keys(fmt, extracted, reference, tmp_path):
    from hsextract import HiddenStatesStream

    dest = tmp_path / fmt
    assert export_cli(extracted, dest, fmt, "--max-length", str(MAX_LEN)).returncode == 0
    in_process = list(HiddenStatesStream(extracted, keys=fmt, max_length=MAX_LEN, prefetch=3))
    streamed = {s["id"]: s for s in in_process}
    # through DataLoader workers: views of the file's pages, small tensors by value, computed ones (speculators'
    # stacked layers) in shared memory; the same records whichever way they crossed
    per_worker = stream_records(extracted, 1, 2, keys=fmt, max_length=MAX_LEN)[0]
    same_records(sorted(per_worker, key=lambda r: r["id"]), sorted(in_process, key=lambda r: r["id"]), fmt)
    assert sorted(streamed) == sorted(rows_of(dest)), "the samples the export kept, no other"
    for sample_id, got in streamed.items():
        ref = {k: v[:MAX_LEN] for k, v in reference[sample_id]["layers"].items()}
        if fmt == "speculators":
            assert set(got) == {"id", "hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask",
                                "lengths", "position_ids"}
            close(got["hidden_states"], torch.cat([ref[k] for k in (1, 3, 4)], -1), sample_id)
            close(got["verifier_last_hidden_states"], ref[7], sample_id)
        else:
            close(got["hidden_states"], torch.cat([ref[k] for k in LAYERS], -1), sample_id)
