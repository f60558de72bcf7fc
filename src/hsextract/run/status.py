"""Human-facing progress: a rich progress bar on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import sys
import threading

from hsextract.run.liveness import Progress


class ProgressReporter:
    """Prints the shard's progress for people: a bar on a terminal, a log line every `interval_s` otherwise."""
    def __init__(self, progress: Progress, mode: str = "auto", interval_s: float = 30.0):
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "log"
        self.progress = progress
        self.mode = mode
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ProgressReporter:
        """Start printing, from a thread of its own."""
        target = self._bar if self.mode == "bar" else self._log
        self._thread = threading.Thread(target=target, name="hsextract-progress", daemon=True)
        self._thread.start()
        return self

    def line(self) -> str:
        """One line of progress: phase, samples, skips, tokens, rate, files, bytes."""
        p = self.progress
        return (f"shard {p.shard}/{p.num_shards} {p.phase}: {p.samples_done}/{p.samples_total} samples "
                f"({p.samples_skipped} skipped), {p.tokens_done} tokens, {p.tokens_per_s():.0f} tok/s, "
                f"{p.files} files, {p.bytes / 1e6:.1f} MB")

    def _log(self) -> None:
        while not self._stop.wait(self.interval_s):
            print(self.line(), flush=True)

    def _bar(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   TextColumn("{task.fields[rate]}"))
        with Bar(*columns, transient=False) as bar:
            task = bar.add_task(f"shard {self.progress.shard}", total=None, rate="")
            while not self._stop.wait(0.5):
                p = self.progress
                bar.update(task, completed=p.samples_done, total=p.samples_total or None,
                           description=f"shard {p.shard} {p.phase}", rate=f"{p.tokens_per_s():.0f} tok/s")
            bar.update(task, completed=self.progress.samples_done)

    def close(self) -> None:
        """Stop, printing a last line."""
        if self._thread is not None and not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=2)
            if self.mode == "log":
                print(self.line(), flush=True)
        self._stop.set()
