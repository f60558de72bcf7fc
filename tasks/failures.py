"""What went wrong in a run, told twice: one line a person reads first, and the evidence behind it.

A `Failure` is one failed shard or host: where (shard, host), `why` (one line: the reason, in the words of
the thing that failed), `evidence` (the command, what it printed, the worker log's tail, the exit record)
and whether trying again can help (`retry`, `hsextract.errors.Retry`, as the failure said it: a missing model
directory, a bad argument or the same error on every shard is NEVER fixed by a re-run). `summary` groups failures
with the same reason into one line each, for the flow run's state message; `report` is the markdown of the
`failure-<run>` artifact that holds the evidence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hsextract.errors import Retry

#: how long a reason may be on its line (the state message stays readable; the evidence has the rest)
WHY_CHARS = 240
#: reason lines in a state message; the rest are counted, and the artifact has every one
MAX_LINES = 8
#: how the reason of a shard that no host could take begins (the hosts' failures say why)
NOT_LAUNCHED = "not launched: no host passed"


def one_line(text: str, limit: int = WHY_CHARS) -> str:
    """`text` on one line (lines joined with ' | '), cut to `limit` characters."""
    text = " | ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def last_line(text: str) -> str:
    """The last line of `text` that says something (a log tail's verdict: the exception, the error)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip() and line.strip() != "..."]
    return lines[-1] if lines else ""


def said(result) -> str:
    """The last line a command printed (stderr first): its own word on what went wrong."""
    return last_line(result.stderr) or last_line(result.stdout) or f"exit {result.returncode}, nothing printed"


@dataclass(frozen=True)
class Failure:
    """One failed shard (`shard` set) or host (`shard` None)."""

    host: str
    why: str
    evidence: str = ""
    retry: Retry = Retry.LATER
    shard: int | None = None
    num_shards: int = 0

    @property
    def where(self) -> str:
        """`shard 3/8 on gpu-a`, `host gpu-a`, `shard 3/8` before any host took it, or `the run` (refused whole)."""
        if self.shard is None:
            return f"host {self.host}" if self.host else "the run"
        return f"shard {self.shard}/{self.num_shards}" + (f" on {self.host}" if self.host else "")

    @property
    def cause(self) -> str:
        """The reason with the numbers that differ from shard to shard (pids, seconds, indices) taken out:
        failures with the same cause are one line of the summary."""
        return re.sub(r"\d+(\.\d+)?", "#", self.why)


def shard_list(shards: list[int]) -> str:
    """`0-3, 7` for [0, 1, 2, 3, 7]."""
    spans: list[list[int]] = []
    for s in sorted(shards):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def grouped(failures: list[Failure]) -> list[tuple[str, str]]:
    """(where, why) per distinct cause: failures of several shards with one cause share a line."""
    groups: dict[tuple[bool, str], list[Failure]] = {}
    for f in failures:
        groups.setdefault((f.shard is None, f.cause), []).append(f)
    lines = []
    for (is_host, _), members in groups.items():
        first = members[0]
        if is_host or len(members) == 1:
            where = ", ".join(m.where for m in members) if is_host else first.where
        else:
            hosts = sorted({m.host for m in members if m.host})
            where = (f"shards {shard_list([m.shard for m in members if m.shard is not None])} of {first.num_shards}"
                     + (f" on {', '.join(hosts)}" if hosts else ""))
        lines.append((where, first.why))
    return lines


def summary(failures: list[Failure]) -> str:
    """One line per distinct cause (`- where: why`), at most MAX_LINES of them."""
    lines = [f"- {where}: {why}" for where, why in grouped(failures)]
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES] + [f"- ... and {len(lines) - MAX_LINES} more cause(s)"]
    return "\n".join(lines)


def same_cause(failures: list[Failure]) -> bool:
    """Whether at least two shards failed, all for one cause that a worker reported as it exited: the mark
    of a mistake in the inputs or the code, which no re-run fixes."""
    shards = [f for f in failures if f.shard is not None]
    return len(shards) >= 2 and len({f.cause for f in shards}) == 1 and "exited with code" in shards[0].why


def report(run: str, headline: str, failures: list[Failure]) -> str:
    """The markdown of the `failure-<run>` artifact: the headline, then every failure with its evidence."""
    parts = [f"# Run `{run}`: why it failed", "", headline, ""]
    for f in failures:
        retry = ("**not retried**: fix it first" if f.retry is Retry.NEVER
                 else "retried by the automation (under the attempt cap)")
        parts += [f"## {f.where}", "", f"**{f.why.replace('`', chr(39))}**", "", f"{retry}.", ""]
        if f.evidence.strip():
            parts += ["```text", f.evidence.strip().replace("```", "'''"), "```", ""]
    return "\n".join(parts)
