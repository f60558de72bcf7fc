"""The CLI and liveness contracts: STARTED first, heartbeats, exit status, clear errors, one writer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import hsextract
from hsextract.run.liveness import EXIT_NAME, HEARTBEAT_NAME

from harness.worker import extract_cmd, run_extract, summary_of


def test_version():
    proc = subprocess.run([sys.executable, "-m", "hsextract", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"hsextract {hsextract.__version__}"


def test_started_first_then_heartbeats_then_exit_status(tiny_model, dataset, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(extract_cmd(tiny_model, dataset, out, 0, 1, "--token-budget", "256"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    first = proc.stdout.readline()
    assert first.startswith(f"STARTED shard=0/1 pid={proc.pid} version={hsextract.__version__}")
    beat_path = out / "shard-00000-of-00001" / HEARTBEAT_NAME
    seen, ended = [], False
    while not ended:
        ended = proc.poll() is not None  # one more look once it ended: its last heartbeat is written before that
        if beat_path.exists():
            beat = json.loads(beat_path.read_text())
            if not seen or beat["time"] != seen[-1]["time"]:
                seen.append(beat)
        time.sleep(0.05)
    proc.communicate()
    assert proc.returncode == 0
    phases = [b["phase"] for b in seen]
    assert "extracting" in phases and phases[-1] == "done"
    assert len(seen) >= 3, "heartbeat refreshed while running"
    assert {"time", "pid", "phase", "samples_done", "samples_total", "tokens_per_s", "last_batch"} <= set(seen[-1])
    assert seen[-1]["samples_done"] == seen[-1]["samples_total"] == 120
    status = json.loads((out / "shard-00000-of-00001" / EXIT_NAME).read_text())
    assert status["code"] == 0 and status["pid"] == proc.pid


@pytest.mark.parametrize("change, message", [
    (dict(model="/nonexistent/model"), "--model '/nonexistent/model': no such directory"),
    (dict(layers="1,8"), "layer id(s) [8] out of range for a model with 8 layers"),
    (dict(layers="dflash:zero"), "dflash:N needs a positive integer"),
    (dict(shard=2, num_shards=2), "--shard 2: must be in 0..1"),
    (dict(data="/nonexistent.jsonl"), "--data '/nonexistent.jsonl': no such file"),
    (dict(out="FILE/sub"), "not writable"),
    (dict(out="gs://bucket/prefix"), "use a local path, file://... or s3://bucket/prefix"),
])
def test_bad_arguments_fail_at_once_naming_the_problem(tiny_model, dataset, tmp_path, change, message):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = dict(model=tiny_model, data=dataset, out=tmp_path / "out", shard=0, num_shards=1, layers="1,3")
    args.update(change)
    if args["out"] == "FILE/sub":
        args["out"] = blocker / "sub"
    cmd = extract_cmd(args["model"], args["data"], args["out"], args["shard"], args["num_shards"],
                      layers=args["layers"])
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.startswith("STARTED")
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_weights_named(tiny_model, dataset, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    tensors = load_file(broken / "model.safetensors")
    dropped = next(k for k in tensors if "layers.2." in k)
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    proc = run_extract(broken, dataset, tmp_path / "out", 0, 1, layers="1,3")
    assert proc.returncode == 2 and "weights missing" in proc.stderr and "layers.2." in proc.stderr
    (broken / "model.safetensors").unlink()
    proc = run_extract(broken, dataset, tmp_path / "out", 0, 1, layers="1,3")
    assert proc.returncode == 2 and str(broken) in proc.stderr, proc.stderr


def test_missing_tokenizer_named(tiny_model, dataset, tmp_path):
    """The tokenizer loads on a thread of its own while the model loads; its failure still ends the worker
    with a usage error that names the model directory, and no sample is journaled."""
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, broken, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    proc = run_extract(broken, dataset, tmp_path / "out", 0, 1, layers="1,3")
    assert proc.returncode == 2, proc.stderr
    assert "cannot load its tokenizer" in proc.stderr and str(broken) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "out").rglob("batch-*.safetensors"))


def test_startup_milestones_from_the_process_start(tiny_model, dataset, tmp_path):
    """The summary's, the heartbeat's and the log's `startup`: each phase and milestone once, in the order the
    worker reaches them, in seconds from the process's own start (so the interpreter's start counts too)."""
    began = time.time()
    proc = run_extract(tiny_model, dataset, tmp_path / "out", 0, 1, layers="1,3")
    ended = time.time()
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
    startup = summary["startup"]
    order = ["importing", "reading_data", "loading_model", "tokenizer_loaded", "model_loaded",
             "first_window_tokenized", "extracting", "first_forward", "first_file"]
    assert list(startup) == order, startup  # on CPU: no kernels to tune or warm
    assert list(startup.values()) == sorted(startup.values()) and startup["importing"] > 0
    assert startup["first_file"] < ended - began  # from the process's start, not before it
    assert startup["model_loaded"] - startup["tokenizer_loaded"] >= summary["load_s"] - 0.01
    heartbeat = json.loads((tmp_path / "out" / "shard-00000-of-00001" / "heartbeat.json").read_text())
    assert heartbeat["startup"] == {**startup, "done": heartbeat["startup"]["done"]}
    assert heartbeat["startup"]["done"] >= startup["first_file"]
    line = next(l for l in proc.stderr.splitlines() if "start-up, from the process start:" in l)
    assert line.endswith(f"extracting {startup['extracting']:.1f}s") and "model_loaded" in line
    ahead = summary["read_ahead"]  # the checkpoint read from before torch's import (the tensors layers 0-3 need)
    assert 0 < ahead["bytes"] == ahead["planned_bytes"] < (tiny_model / "model.safetensors").stat().st_size
    assert 0 < ahead["done_at"] < startup["model_loaded"] and "error" not in ahead and "stopped" not in ahead
    assert ahead["zero_copy"] is True  # sent to /dev/null, no copy into the worker (confined, it may write there)
    preload = summary["preload"]  # the tensors read into the model's memory beside the imports, and used
    assert preload["used"] is True and 0 < preload["bytes"] == preload["planned_bytes"] <= ahead["bytes"]
    assert preload["waited_s"] >= 0  # for the read-ahead, which it follows
    assert 0 < preload["done_at"] < startup["model_loaded"] and "error" not in preload and "stopped" not in preload
    assert "(read to the device beside the imports)" in proc.stderr
    files = run_extract(tiny_model, dataset, tmp_path / "files", 0, 1, "--load-after-imports", layers="1,3")
    assert files.returncode == 0 and "(through host memory)" in files.stderr, files.stderr
    later = json.loads(files.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
    assert "preload" not in later and later["read_ahead"]["bytes"] == ahead["bytes"]
    off = run_extract(tiny_model, dataset, tmp_path / "off", 0, 1, "--read-ahead-gb", "0", layers="1,3")
    assert off.returncode == 0
    assert not {"read_ahead", "preload"} & set(json.loads(off.stdout.split("SUMMARY ", 1)[1].splitlines()[0]))


def test_the_worker_hides_scikit_learn_from_transformers(tmp_path):
    """transformers imports scikit-learn at module level where it is installed (5.17, on the GPU machine's image:
    1.3 s of the worker's start); the worker makes it look absent. A stand-in package shows both sides."""
    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text("__version__ = '1.0'\n")
    (tmp_path / "scikit_learn-1.0.dist-info").mkdir()
    (tmp_path / "scikit_learn-1.0.dist-info" / "METADATA").write_text("Name: scikit-learn\nVersion: 1.0\n")
    probe = ("import sys; from hsextract.cli import hide_unused_packages\n"
             "if sys.argv[1] == 'hide': hide_unused_packages()\n"
             "from transformers.utils import is_sklearn_available; print(is_sklearn_available())")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    seen = {how: subprocess.run([sys.executable, "-c", probe, how], capture_output=True, text=True, env=env,
                                check=True).stdout.strip() for how in ("show", "hide")}
    assert seen == {"show": "True", "hide": "False"}


def test_random_weights_need_only_the_config_and_tokenizer_and_are_the_seeds(tiny_model, dataset, tmp_path):
    """--random-weights SEED: a model directory without weights extracts (the states of a model made from the
    config and the seed), the same seed gives the same states, another seed others, and the files say so."""
    bare = tmp_path / "config-only"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    assert not list(bare.glob("*.safetensors"))

    def states(seed: int, out: str) -> tuple[dict, str]:
        proc = run_extract(bare, dataset, tmp_path / out, 0, 1, "--token-budget", "512", "--random-weights",
                           str(seed), layers="1,3")
        assert proc.returncode == 0, proc.stderr
        assert f"--random-weights {seed}" in proc.stderr and "states are of a random model" in proc.stderr
        assert "model loaded in " in proc.stderr and "(made on the device from the seed)" in proc.stderr
        summary = json.loads(proc.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
        assert 0 < summary["load_s"] < summary["seconds"]
        found = {s["id"]: s["hidden_states"] for s in hsextract.read_samples(tmp_path / out, verify=True)}
        first = next((tmp_path / out).rglob("batch-*.safetensors"))
        from safetensors import safe_open

        with safe_open(str(first), "pt") as handle:
            return found, handle.metadata().get("random_weights")

    one, seed_said = states(7, "a")
    again, _ = states(7, "b")
    other, _ = states(8, "c")
    assert seed_said == "7" and len(one) == len(set(json.loads(l)["id"] for l in dataset.read_text().splitlines()))
    assert all(torch.equal(one[i], again[i]) for i in one)
    assert not any(torch.allclose(one[i], other[i]) for i in one)
    proc = run_extract(tiny_model, dataset, tmp_path / "w", 0, 1, layers="1,3")  # the weights read: said how
    assert proc.returncode == 0 and "model loaded in " in proc.stderr
    assert "(read to the device beside the imports)" in proc.stderr
    proc = run_extract(bare, dataset, tmp_path / "d", 0, 1, layers="1,3")  # without the flag: the weights are needed
    assert proc.returncode == 2 and "cannot load weights" in proc.stderr, proc.stderr


def test_second_writer_of_a_shard_is_refused(tiny_model, dataset, tmp_path):
    out = tmp_path / "out"
    first = subprocess.Popen(extract_cmd(tiny_model, dataset, out, 0, 1, "--token-budget", "128"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    beat = out / "shard-00000-of-00001" / HEARTBEAT_NAME
    # the first heartbeat comes before torch is imported; the lock is held from reading_data on
    while not beat.exists() or json.loads(beat.read_text())["phase"] not in ("loading_model", "extracting"):
        assert first.poll() is None
        time.sleep(0.02)
    second = run_extract(tiny_model, dataset, out, 0, 1)
    exit_path = beat.parent / "exit.json"
    if first.poll() is None:  # the live worker's status files are its own: the refused one wrote none
        assert not exit_path.exists(), exit_path.read_text()
        assert json.loads(beat.read_text())["pid"] == first.pid
    first.communicate(timeout=120)
    assert first.returncode == 0
    assert second.returncode == 75, "busy, not a usage error: trying later can work"
    assert f"already being written by pid {first.pid}" in second.stderr
    assert json.loads(exit_path.read_text())["code"] == 0


def test_dataset_and_iterator_agree(tiny_model, dataset, tmp_path):
    out = tmp_path / "out"
    assert run_extract(tiny_model, dataset, out, 0, 2).returncode == 0
    assert run_extract(tiny_model, dataset, out, 1, 2).returncode == 0
    records = list(hsextract.read_samples(out, verify=True))
    ds = hsextract.HiddenStatesDataset(f"file://{out}")
    assert len(ds) == len(records) == 120
    for n in (0, 57, 119):
        a, b = ds[n], records[n]
        assert a["id"] == b["id"] and torch.equal(a["hidden_states"], b["hidden_states"])
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    # a corrupted file is caught by verify
    victim = next(out.glob("shard-00001-of-00002/batch-*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        list(hsextract.read_samples(out, verify=True))


def test_files_hashed_in_parallel_are_written_in_order_and_identical(tiny_model, dataset, tmp_path):
    """Three files hashed at once: the write thread still takes them in order, and the shard is the same,
    byte for byte, as with one hashing thread (every journaled sha256 is the file's)."""
    shards = {}
    for threads in (1, 3):
        out = tmp_path / f"h{threads}"
        proc = run_extract(tiny_model, dataset, out, 0, 1, "--token-budget", "64", "--hash-threads", str(threads))
        assert proc.returncode == 0, proc.stderr
        timings = summary_of(proc)["pipeline"]  # where the writer's time went
        assert {"held_s", "copy_wait_s", "prepare_s", "hash_s", "write_s", "seal_s", "first_file_s"} <= set(timings)
        assert timings["hash_s"] > 0 and timings["seal_s"] > 0
        shard = out / "shard-00000-of-00001"
        entries = [json.loads(l) for l in (shard / "journal.jsonl").read_text().splitlines() if '"kind":"file"' in l]
        assert [e["file"] for e in entries] == [f"batch-{n:06d}.safetensors" for n in range(1, len(entries) + 1)]
        for e in entries:
            assert hashlib.sha256((shard / e["file"]).read_bytes()).hexdigest() == e["sha256"], e["file"]
        shards[threads] = [(e["file"], e["sha256"], e["ids"]) for e in entries]
    assert len(shards[3]) > 10 and shards[3] == shards[1]
