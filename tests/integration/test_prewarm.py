"""Kernel tuning in child processes while the model loads (hsextract.run.prewarm): real processes, the tiny hybrid.

On CPU the linear-attention module runs transformers' PyTorch path (nothing to tune); what is tested here is
the plumbing the GPU relies on: the children run their share of the sizes on a module built from config.json
alone, the first one signals the others, a failed or slow child costs only its sizes, and the worker reports
them. What they save on a GPU is measured in benchmarks/ (gpu_session.sh)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import hsextract
from hsextract.errors import UsageError
from hsextract.options import WorkerOptions
from hsextract.run.prewarm import Prewarm, WarmThread, shares, standalone_modules
from harness.worker import run_extract, summary_of


def test_sizes_are_dealt_round_robin_and_no_child_is_idle():
    assert shares([1, 2, 3, 4, 5], 2) == [[1, 3, 5], [2, 4]]
    assert shares([1, 2], 8) == [[1], [2]]
    assert shares([7], 0) == [[7]] and shares([], 3) == []


def test_a_child_builds_the_linear_attention_from_the_config_alone(tiny_model, tmp_path):
    import shutil

    bare = tmp_path / "config-only"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    modules, hidden = standalone_modules(bare, torch.device("cpu"), torch.float32)
    assert [type(m).__name__ for m in modules] == ["Qwen3_5GatedDeltaNet"] and hidden == 64
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for m in modules for p in m.parameters())
    out = subprocess.run([sys.executable, "-m", "hsextract.run.prewarm", "--model", str(bare), "--device", "cpu",
                          "--dtype", "float32", "--token-budget", "512", "--sizes", "1,3,32"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tuned 1 module kind(s) for 3 batch sizes" in out.stdout


def test_the_others_wait_for_the_first_childs_signal_or_its_end(tiny_model, tmp_path):
    """The first child tunes the batch-size-independent kernels alone; the others start after it."""
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        waiter = subprocess.Popen([sys.executable, "-m", "hsextract.run.prewarm", "--model", str(tiny_model), "--device",
                                   "cpu", "--dtype", "float32", "--token-budget", "64", "--sizes", "2",
                                   "--after", str(ready), "--after-pid", str(holder.pid)],
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(12)  # imports and the module are done well before this: it is waiting
        assert waiter.poll() is None
        ready.touch()
        out, _ = waiter.communicate(timeout=60)
        assert waiter.returncode == 0 and "for 1 batch sizes" in out
        # a first child that dies without signalling releases them too
        waiter = subprocess.Popen([sys.executable, "-m", "hsextract.run.prewarm", "--model", str(tiny_model), "--device",
                                   "cpu", "--dtype", "float32", "--token-budget", "64", "--sizes", "2",
                                   "--after", str(tmp_path / "never"), "--after-pid", str(holder.pid)],
                                  stdout=subprocess.PIPE, text=True)
        holder.kill()
        holder.wait()
        out, _ = waiter.communicate(timeout=60)
        assert waiter.returncode == 0 and "for 1 batch sizes" in out
    finally:
        holder.kill()
        holder.wait()


def test_a_failed_or_slow_child_is_recorded_with_what_it_printed(tiny_model, tmp_path):
    missing = tmp_path / "no-such-model"
    failed = Prewarm.start(missing, [1, 2], 64, "cpu", torch.float32, procs=2)
    failed.wait(timeout=120)
    assert len(failed.failures) == 2 and all(f.startswith("exit 1: ") for f in failed.failures)
    assert all(str(missing) in f for f in failed.failures), failed.failures  # the command and its error
    assert not failed.ready.parent.exists()
    slow = Prewarm.start(tiny_model, [1, 2, 4], 64, "cpu", torch.float32, procs=3)
    slow.wait(timeout=0.5)  # far less than their imports take
    assert len(slow.failures) == 3 and all(f.startswith("killed after 0s: ") for f in slow.failures)
    assert all(proc.poll() is not None for _cmd, proc, _log in slow.procs)


def test_the_worker_starts_the_children_reports_them_and_not_again_once_the_host_is_tuned(tiny_model, dataset,
                                                                                          tmp_path):
    cache = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    proc = run_extract(tiny_model, dataset, tmp_path / "out", 0, 1, "--token-budget", "256", "--device", "cpu",
                       "--tune-procs", "2", layers="1,3", env=cache)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(proc)
    assert summary["tune"]["procs"] == 2 and summary["tune"]["failed"] == 0
    assert summary["tune"]["seconds"] >= summary["load_s"]  # started before the load, waited for after it
    assert "2 tuning process(es) done " in proc.stderr and "; failed:" not in proc.stderr
    milestones = list(summary["startup"])  # waited for after the load, before the first window's tokens
    assert milestones.index("kernels_tuned") == milestones.index("model_loaded") + 1
    assert summary["startup"]["kernels_tuned"] - summary["startup"]["loading_model"] >= summary["tune"]["seconds"] - 0.5
    assert summary["samples_done"] == summary["samples_total"] > 0
    assert len(list(hsextract.read_samples(tmp_path / "out", verify=True))) == summary["samples_total"]
    marker, = (tmp_path / "triton" / "hsextract-tuned").iterdir()  # every size tuned: the host is marked
    # the next start on this host: nothing to tune, no children
    again = run_extract(tiny_model, dataset, tmp_path / "again", 0, 1, "--token-budget", "256", "--device", "cpu",
                        "--tune-procs", "2", layers="1,3", env=cache)
    assert again.returncode == 0 and summary_of(again)["tune"] == {"procs": 0, "tuned_before": True}
    assert f"kernels tuned on this host before ({marker})" in again.stderr and "tuning process(es)" not in again.stderr
    # another budget is other sizes: tuned again
    other = run_extract(tiny_model, dataset, tmp_path / "other", 0, 1, "--token-budget", "512", "--device", "cpu",
                        "--tune-procs", "1", layers="1,3", env=cache)
    assert other.returncode == 0 and summary_of(other)["tune"]["procs"] == 1
    # none by default: no children, no `tune` in the summary
    plain = run_extract(tiny_model, dataset, tmp_path / "plain", 0, 1, "--token-budget", "256", "--device", "cpu",
                        layers="1,3", env=cache)
    assert plain.returncode == 0 and "tune" not in summary_of(plain) and "tuning process" not in plain.stderr


def test_the_thread_beside_the_load_runs_every_size_and_stops_when_told(tiny_model):
    """The default on CUDA (`WarmThread`): modules built on the caller's thread, run on a thread of their own."""
    sizes = list(range(1, 33))
    warm = WarmThread.start(tiny_model, sizes, 512, "cpu", torch.float32)
    assert warm.wait(timeout=120) >= 0 and warm.failures == [] and warm.sizes_done == len(sizes)
    assert warm.procs == ()  # what the worker's summary counts
    many = WarmThread.start(tiny_model, list(range(1, 5000)), 1 << 20, "cpu", torch.float32)
    many.kill(wait=True)  # stops after the size under way
    assert many.sizes_done < 4999 and not many._thread.is_alive()
    slow = WarmThread.start(tiny_model, list(range(1, 5000)), 1 << 20, "cpu", torch.float32)
    slow.wait(timeout=0.0)
    assert slow.failures and slow.failures[0].startswith("not done after 0s: ") and not slow._thread.is_alive()
    # a failure inside the thread is recorded, never raised: the warm-up after the load does what is left
    odd = WarmThread([torch.nn.Linear(3, 3)], [2], 64, 64, torch.device("cpu"), torch.float32)  # 64 != 3 features
    odd.wait(timeout=60)
    assert len(odd.failures) == 1 and odd.failures[0].startswith("RuntimeError: "), odd.failures


def test_the_cuda_start_thread_hands_its_error_to_the_worker_s_thread():
    """`CudaStart` makes the context on a thread; off CUDA it does nothing, and what the thread raised (here: no
    GPU on this machine) is raised by `wait` on the worker's thread, as the load would have raised it."""
    from hsextract.run.extract import CudaStart

    assert CudaStart("cpu").wait() is None
    if torch.cuda.is_available():
        assert CudaStart("cuda").wait() >= 0
        return
    start = CudaStart("cuda")
    with pytest.raises((RuntimeError, AssertionError)):
        start.wait()
    assert start.seconds is not None and not start.thread.is_alive()


def test_a_negative_count_is_refused_naming_the_option(tmp_path):
    opts = WorkerOptions(model=tmp_path, data=tmp_path / "d.jsonl", out=str(tmp_path / "o"), layers="1",
                         tune_procs=-1)
    with pytest.raises(UsageError, match=r"--tune-procs -1: must be 0 \(none\) or more"):
        opts.check()
