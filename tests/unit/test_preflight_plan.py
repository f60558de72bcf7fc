"""The preflight's pure parts: the host facts it parses, what a worker needs of a GPU and a disk, the plan's
arithmetic. (The checks themselves run against real hosts: tests/integration/test_preflight.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

from hsextract.options import WorkerOptions
from tasks.commands import facts_cmd, parse_facts
from tasks.preflight import HostReport, bytes_per_token, gpu_need, judge_disk, plan_figures


def options(**kw) -> WorkerOptions:
    return WorkerOptions(model=Path("/m"), data=Path("/d.jsonl"), out=kw.pop("out", "s3://b/p"), layers="1,3", **kw)


def test_the_facts_command_runs_in_a_plain_shell_and_parses(tmp_path):
    out = subprocess.run(["/bin/sh", "-c", facts_cmd(str(tmp_path / "not" / "yet"), str(tmp_path))],
                         capture_output=True, text=True)
    facts = parse_facts(out.stdout)
    assert abs(facts["now"] - __import__("time").time()) < 5
    assert set(facts["df"]) == {"workdir", "output"} and facts["df"]["workdir"][0] > 0  # nearest existing parent
    assert facts["gpus"] is None or isinstance(facts["gpus"], list)


def test_nvidia_smi_lines_and_its_failure():
    ok = parse_facts("NOW 1.5\n---GPUS\n0, NVIDIA H200, 143771, 140000\n1, NVIDIA H200, 143771, 20000\n---END 0\n")
    assert [g["index"] for g in ok["gpus"]] == [0, 1] and ok["gpus"][1]["free"] == 20000 << 20
    bad = parse_facts("NOW 1.5\n---GPUS\nNVIDIA-SMI has failed because it couldn't communicate with the driver\n"
                      "---END 9\n")
    assert bad["gpus"] == [] and "couldn't communicate" in bad["smi"]
    assert parse_facts("NOW 1\nNO NVIDIA-SMI\n")["smi"] == "nvidia-smi not found"


def test_what_a_worker_needs_of_its_gpu():
    found = {"num_layers": 64, "layers": [1, 16, 31, 46, 61], "hidden_size": 5120, "model_bytes": 54 << 30}
    need = gpu_need(found, options(token_budget=8192))
    # 62 of 64 layers' weights, the activations of 8192 tokens, the CUDA context
    assert 54 * 62 / 64 * 2**30 < need < 54 * 2**30 + 3 * 2**30
    assert gpu_need({**found, "layers": [1]}, options()) < need / 10


def test_bytes_per_token_follow_the_output_dtype():
    assert bytes_per_token(options(), 5120, 5, on_gpu=True) == 5120 * 5 * 2
    assert bytes_per_token(options(), 64, 2, on_gpu=False) == 64 * 2 * 4  # float32 on CPU
    assert bytes_per_token(options(out_dtype="fp8_e4m3"), 5120, 5, on_gpu=True) < 5120 * 5 * 2 * 0.55
    assert bytes_per_token(options(include_last=True), 5120, 5, on_gpu=True) == 5120 * 6 * 2


def test_disk_verdicts_for_a_spool_and_a_local_output():
    report = HostReport("h", facts={"df": {"workdir": (10 << 30, "/"), "output": (1 << 30, "/out")}})
    judge_disk(report, options(spool_high_gb=64.0), shard_bytes=4 << 30, workers=2, shards=4)
    assert report.checks["disk"].status == "ok"  # two spools of 4 GiB fit in 10
    judge_disk(report, options(spool_high_gb=64.0), shard_bytes=8 << 30, workers=2, shards=4)
    assert report.checks["disk"].status == "fail" and "need ~16.0 GiB" in report.checks["disk"].detail
    judge_disk(report, options(spool_high_gb=2.0), shard_bytes=8 << 30, workers=2, shards=4)
    assert report.checks["disk"].status == "ok"  # a spool never holds more than spool_high_gb
    judge_disk(report, options(out="/out"), shard_bytes=1 << 28, workers=2, shards=5)
    assert report.checks["disk"].status == "fail" and "output disk (/out)" in report.checks["disk"].detail


def test_the_plan_in_numbers():
    plan = plan_figures(tokens=1_000_000_000, samples=913_000, bytes_per_tok=51_200, gpus=256, rate=9_000.0,
                        options=options(token_budget=8192, upload_part_mb=64), num_shards=256)
    assert plan["output_bytes"] == 51_200 * 10**9
    assert round(plan["gpu_hours"], 1) == round(1e9 / 9000 / 3600, 1)
    assert abs(plan["wall_hours"] - plan["gpu_hours"] / 256) < 1e-9
    # a file per batch: 8192 x 51,200 B = 400 MiB -> 7 parts + create + complete, + the journal
    files_per_s = 9000 * 256 / 8192
    assert abs(plan["s3_requests_per_s"] - files_per_s * 10) < 1e-6
    assert "gpu_hours" not in plan_figures(10, 1, 1, 1, None, options(), 1)
