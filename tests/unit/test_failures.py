"""How a run's failures are told: one line per cause, the evidence apart, mistakes told from bad luck."""

from __future__ import annotations

from hsextract.errors import Retry
from tasks.failures import Failure, grouped, one_line, report, same_cause, shard_list, summary
from tasks.runstatus import RunProgress, render, totals


def shard(i: int, why: str, host: str = "gpu-a", n: int = 8, **kw) -> Failure:
    return Failure(host, why, evidence=f"log of shard {i}\n{why}", shard=i, num_shards=n, **kw)


def test_one_cause_on_many_shards_is_one_line():
    failures = [shard(i, f"worker pid {100 + i} exited with code 2: usage: --model '/m': no such directory "
                         f"(after 0.{i}s)") for i in range(4)] + [shard(7, "lost: worker pid 9 is gone", "gpu-b")]
    lines = summary(failures).splitlines()
    assert lines[0].startswith("- shards 0-3 of 8 on gpu-a: worker pid 100 exited with code 2") and len(lines) == 2
    assert lines[1] == "- shard 7/8 on gpu-b: lost: worker pid 9 is gone"
    assert "log of shard" not in summary(failures), "the evidence is not in the summary"


def test_hosts_keep_their_own_lines_and_long_lists_are_cut():
    hosts = [Failure(f"h{i}", "--model '/m': no such directory", retry=Retry.NEVER) for i in range(2)]
    assert grouped(hosts) == [("host h0, host h1", "--model '/m': no such directory")]
    many = [shard(i, f"error kind {'abcdefghijkl'[i]}") for i in range(12)]
    lines = summary(many).splitlines()
    assert len(lines) == 9 and lines[-1] == "- ... and 4 more cause(s)"


def test_same_cause_needs_two_shards_a_worker_exit_and_one_reason():
    exit1 = "worker exited with code 1: RuntimeError: bad config"
    assert same_cause([shard(0, exit1), shard(1, exit1)])
    assert not same_cause([shard(0, exit1)]), "one shard is not 'every shard'"
    assert not same_cause([shard(0, exit1), shard(1, "worker exited with code 1: OSError: disk")])
    assert not same_cause([shard(0, "lost: worker pid 3 is gone"), shard(1, "lost: worker pid 4 is gone")]), \
        "a lost worker is bad luck, not a mistake"


def test_report_holds_every_failure_with_its_evidence():
    text = report("r1", "run r1: 2 of 8 shard(s) failed", [shard(0, "boom ``` x", retry=Retry.NEVER), shard(1, "b")])
    assert text.count("## shard") == 2 and "log of shard 0" in text and "**not retried**" in text
    assert text.count("```") == 4, "evidence fences are not broken by the evidence"


def test_small_helpers():
    assert shard_list([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10"
    assert one_line("a\n\n b \nc", 100) == "a | b | c" and len(one_line("x" * 500, 50)) == 50


def test_status_estimates_what_it_cannot_know_yet():
    rows = [{"state": "done", "samples_done": 50, "samples_total": 50, "skipped": 1, "tokens_done": 5000},
            {"state": "running", "samples_done": 10, "samples_total": 40, "skipped": 0, "tokens_done": 1000},
            {"state": "pending", "samples_done": 0, "samples_total": 0, "skipped": 0, "tokens_done": 0}]
    t = totals(rows)
    assert t.samples_done == 60 and t.samples_total == 135 and t.estimated
    progress = RunProgress()
    progress.add(totals(rows[:2] + [dict(rows[2], samples_done=0)]), now=progress.started)
    progress.add(t, now=progress.started + 10)
    rows[1]["samples_done"] = 30
    progress.add(totals(rows), now=progress.started + 20)
    assert progress.rates()[0] == 1.0, "20 samples in 20 s"
    text = render("r1", 3, totals(rows), progress, [("shard 2/3 on h", "lost")])
    assert "80 of ~135 done" in text and "| ETA |" in text and "lost" in text and "1 pending" in text
