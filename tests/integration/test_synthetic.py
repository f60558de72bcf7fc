"""The synthetic worker (`hsextract extract --synthetic TOKENS_PER_S`): no model, no torch, the real path.

Real processes through the real CLI, the tiny model's config (its hidden size and layers set the per-token
size), a real S3 endpoint; what lands is read back with the reader and reconciled against the dataset."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

import hsextract
from harness.worker import dataset_ids, extract_cmd, run_extract, summary_of
from hsextract.errors import UsageError
from hsextract.options import WorkerOptions
from hsextract.store import S3Store
from tasks.reconcile import dataset_ids as ids_of, reconcile_output

LAYERS = "1,3"  # the tiny model: hidden size 64, so 2 x 64 bf16 = 256 bytes a token


def test_writes_every_sample_once_at_the_real_size_and_no_faster_than_asked(tiny_model, dataset, tmp_path):
    rate = 4000
    proc = run_extract(tiny_model, dataset, tmp_path / "out", 0, 1, "--token-budget", "256", "--synthetic",
                       str(rate), layers=LAYERS)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert "synthetic: no model; random states of 256 bytes a token at 4000 tokens/s" in proc.stderr
    assert summary["samples_done"] == summary["samples_written"] == len(dataset_ids(dataset))
    assert summary["tokens_per_s"] <= rate * 1.02  # paced: as long as a GPU at that rate would take
    assert summary["pipeline"]["sleep_s"] > 0 and summary["files"] == summary["forward_passes"] > 1
    samples = list(hsextract.read_samples(tmp_path / "out", verify=True))
    assert sorted(s["id"] for s in samples) == sorted(dataset_ids(dataset))
    assert all(s["hidden_states"].shape == (len(s["input_ids"]), 128) for s in samples)
    assert sum(len(s["input_ids"]) for s in samples) == summary["tokens"]
    first = next((tmp_path / "out").rglob("batch-*.safetensors"))
    header = json.loads(first.read_bytes()[8:8 + int.from_bytes(first.read_bytes()[:8], "little")])
    meta = header["__metadata__"]
    assert meta["synthetic"] == "4000" and meta["layer_ids"] == "[1, 3]" and meta["hidden_size"] == "64"


def test_imports_no_torch(tiny_model, dataset, tmp_path):
    code = ("import sys\nfrom hsextract.cli import main\nrc = main(sys.argv[1:])\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'safetensors', "
            "'tokenizers', 'numpy'})\nprint('HEAVY', heavy, rc)\n")
    cmd = extract_cmd(tiny_model, dataset, tmp_path / "out", 0, 2, "--synthetic", "1e6", layers=LAYERS)
    out = subprocess.run([sys.executable, "-c", code, *cmd[3:]], capture_output=True, text=True, timeout=120)
    assert "HEAVY [] 0" in out.stdout, (out.stdout[-2000:], out.stderr[-2000:])


def test_pre_tokenized_records_keep_their_tokens_and_fp8_has_its_scales(tiny_model, tmp_path):
    data = tmp_path / "tok.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "input_ids": list(range(5, 5 + 3 + i)),
                                        "loss_mask": [0] + [1] * (2 + i)}) + "\n" for i in range(6)))
    proc = run_extract(tiny_model, data, tmp_path / "out", 0, 1, "--synthetic", "1e6", "--out-dtype", "fp8_e4m3",
                       layers=LAYERS)
    assert proc.returncode == 0, proc.stderr
    samples = {s["id"]: s for s in hsextract.read_samples(tmp_path / "out", verify=True)}
    assert sorted(samples) == [f"t{i}" for i in range(6)]
    for i in range(6):
        s = samples[f"t{i}"]
        assert s["input_ids"].tolist() == list(range(5, 5 + 3 + i)) and s["loss_mask"].tolist() == [0] + [1] * (2 + i)
        assert s["hidden_states"].shape == (3 + i, 128)  # dequantized: bf16 of the real width


def test_a_stop_journals_the_file_in_flight_and_the_next_run_finishes_the_rest(tiny_model, dataset, tmp_path):
    out = tmp_path / "out"
    cmd = extract_cmd(tiny_model, dataset, out, 0, 1, "--token-budget", "128", "--synthetic", "300", layers=LAYERS)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    journal = out / "shard-00000-of-00001" / "journal.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (journal.exists() and '"kind":"file"' in journal.read_text()):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    exit_record = json.loads((out / "shard-00000-of-00001" / "exit.json").read_text())
    assert exit_record["code"] == 143 and "SIGTERM" in exit_record["reason"]
    written = [json.loads(line) for line in journal.read_text().splitlines() if '"kind":"file"' in line]
    assert 0 < sum(len(e["ids"]) for e in written) < len(dataset_ids(dataset))
    again = run_extract(tiny_model, dataset, out, 0, 1, "--token-budget", "128", "--synthetic", "1e6", layers=LAYERS)
    assert again.returncode == 0, again.stderr
    ids = [s["id"] for s in hsextract.read_samples(out, verify=True)]
    assert sorted(ids) == sorted(dataset_ids(dataset))  # each exactly once


def test_lands_in_s3_through_the_upload_path_and_reconciles(tiny_model, dataset, tmp_path, s3, s3_endpoint):
    client, bucket = s3
    for shard in range(2):
        proc = run_extract(tiny_model, dataset, f"s3://{bucket}/syn", shard, 2, "--token-budget", "256",
                           "--synthetic", "1e6", "--spool", str(tmp_path / f"spool{shard}"), "--s3-endpoint",
                           s3_endpoint, layers=LAYERS)
        assert proc.returncode == 0, proc.stderr
        assert summary_of(proc)["upload"]["files"] == summary_of(proc)["files"] > 0
    report = reconcile_output(S3Store(f"s3://{bucket}/syn", client=client), ids_of(dataset), 2, verify=True)
    assert report.done == report.expected == len(dataset_ids(dataset)) and report.sealed, report
    assert not report.missing_ids and not report.corrupt_objects and not report.duplicated


@pytest.mark.parametrize("extra,message", [
    ({"synthetic": 0.0}, r"--synthetic 0: must be a positive number of tokens a second"),
    ({"synthetic": 10.0, "random_weights": 1}, r"--synthetic and --random-weights: choose one"),
])
def test_bad_rates_are_refused_naming_the_option(tmp_path, extra, message):
    opts = WorkerOptions(model=tmp_path, data=tmp_path / "d.jsonl", out=str(tmp_path / "o"), layers="1", **extra)
    with pytest.raises(UsageError, match=message):
        opts.check()
