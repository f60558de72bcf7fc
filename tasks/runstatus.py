"""The run-level status a person reads first: whole-run progress, rate, ETA, shards by state, why shards failed.

`RunProgress` keeps the run's totals over time (from the shard rows the board holds) and `render` writes
the markdown of the `status-<run>` artifact. Totals a run cannot know yet (the samples of a shard that has
not started) are estimated from the shards that have, and marked with `~`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 120.0  # rate over the last two minutes (over the whole run until then)


def human(n: float) -> str:
    """1234 -> 1.2K, 5_600_000 -> 5.6M."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def duration(seconds: float | None) -> str:
    """90 -> 1m 30s; None -> '?'."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s" if m else f"{s}s"


@dataclass
class Totals:
    """The run's counts at one moment."""

    samples_done: int = 0
    samples_total: float = 0.0   # estimated for shards that have not reported one
    estimated: bool = False
    skipped: int = 0
    tokens_done: int = 0
    states: dict = field(default_factory=dict)


def totals(rows: list[dict]) -> Totals:
    """Sum the rows (`samples_done`, `samples_total`, `tokens_done`, `skipped`, `state`) of a run's shards."""
    t = Totals()
    known = [r["samples_total"] for r in rows if r["samples_total"]]
    mean = sum(known) / len(known) if known else 0.0
    for r in rows:
        t.states[r["state"]] = t.states.get(r["state"], 0) + 1
        t.samples_done += r["samples_done"]
        t.skipped += r["skipped"]
        t.tokens_done += r["tokens_done"]
        if r["samples_total"]:
            t.samples_total += r["samples_total"]
        elif r["state"] not in ("complete",):
            t.samples_total += mean
            t.estimated = True
    return t


class RunProgress:
    """Samples and tokens done over time: the rate (over RATE_WINDOW_S) and the ETA."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.points: deque[tuple[float, int, int]] = deque()

    def add(self, t: Totals, now: float | None = None) -> None:
        """Record the totals of now."""
        now = time.monotonic() if now is None else now
        self.points.append((now, t.samples_done, t.tokens_done))
        while len(self.points) > 2 and now - self.points[1][0] > RATE_WINDOW_S:
            self.points.popleft()

    def rates(self) -> tuple[float, float]:
        """(samples/s, tokens/s) over the window; zero until two points are apart."""
        if len(self.points) < 2 or self.points[-1][0] - self.points[0][0] < 1.0:
            return 0.0, 0.0
        (t0, s0, k0), (t1, s1, k1) = self.points[0], self.points[-1]
        return max(0.0, (s1 - s0) / (t1 - t0)), max(0.0, (k1 - k0) / (t1 - t0))


def render(run: str, num_shards: int, t: Totals, progress: RunProgress, failed: list[tuple[str, str]],
           verdict: str = "", links: dict[str, str] | None = None) -> str:
    """The markdown of `status-<run>`: a headline, the progress table, shards by state, and what failed (hosts
    and shards) with the one line that says why."""
    percent = 100.0 * t.samples_done / t.samples_total if t.samples_total else 0.0
    samples_s, tokens_s = progress.rates()
    left = max(0.0, t.samples_total - t.samples_done - t.skipped)
    eta = left / samples_s if samples_s > 0 else None
    approx = "~" if t.estimated else ""
    tokens_total = t.tokens_done / t.samples_done * t.samples_total if t.samples_done else 0
    state = verdict or ("running" if t.states.get("running") or t.states.get("launching") else "starting")
    lines = [f"## Run `{run}`: {state}, {percent:.1f}% of samples", "",
             "| | |", "|---|---|",
             f"| samples | {t.samples_done:,} of {approx}{t.samples_total:,.0f} done ({percent:.1f}%), "
             f"{t.skipped:,} skipped with a reason |" if t.samples_total else
             "| samples | none done yet (a shard's total is known once it started) |",
             f"| tokens | {human(t.tokens_done)} done" + (f" of ~{human(tokens_total)} |" if tokens_total else " |"),
             f"| rate | {samples_s:.1f} samples/s, {human(tokens_s)} tokens/s |",
             f"| ETA | {'-' if verdict else duration(eta)} |",
             f"| elapsed | {duration(time.monotonic() - progress.started)} |",
             f"| shards ({num_shards}) | " + ", ".join(f"{n} {s}" for s, n in sorted(t.states.items())) + " |", ""]
    if failed:
        lines += ["### What failed", "", "| where | why |", "|---|---|"]
        lines += [f"| {where} | {why.replace('|', '/')} |" for where, why in failed]
        lines.append("")
    for label, target in (links or {}).items():
        lines.append(f"- {label}: {target}")
    return "\n".join(lines)
