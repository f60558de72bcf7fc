"""The attempt record: how often each shard of a run failed, where, why, and how it last ended.

Durable data of its own, beside the journals in the output: `<output>/_runs/<run>/attempts.json`, keyed by
shard directory (so shard i of N never mixes with shard i of M):

    {"shard-00001-of-00002": {"failed_attempts": 1, "last_failed_host": "gpu2", "last_error": "...",
                              "last": {"state": "done", "host": "gpu1", "gpu": 0, "samples": "48/48", ...}}}

The attempt cap (`max_attempts`) and the placement of a shard away from the host it last failed on read it;
the UI's shard table draws its attempt columns, and the rows of shards a run does not touch, from it. Every
change is a conditional write (`Store.update`), so two runs of one run name never lose each other's
counts; changes made while a write is under way go out together in the next one. Where the orchestrator
cannot reach the output (a file:// output only the hosts see), the record lives in this run's memory only,
and the run says so in its log.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from hsextract.output.journal import shard_dir_name
from hsextract.store import Store

from .failures import one_line


@dataclass
class ShardAttempts:
    """One shard's history across the runs of a run name."""

    failed_attempts: int = 0
    last_failed_host: str = ""
    last_error: str = ""
    last: dict = field(default_factory=dict)  # the shard's table row when a run last left it (state, host, ...)


Change = Callable[[ShardAttempts], None]


class AttemptRecord:
    """The record of run `run` for `num_shards` shards in `store`. `reachable()` says whether the orchestrator
    can write there now (a file:// output appears once a worker made it); until it can, changes wait in memory."""

    def __init__(self, store: Store, run: str, num_shards: int, log=None, reachable: Callable[[], bool] = lambda: True):
        self.store, self.run, self.num_shards, self.log, self.reachable = store, run, num_shards, log, reachable
        self.key = f"_runs/{run}/attempts.json"
        self._shards: dict[str, ShardAttempts] = {}
        self._pending: dict[str, list[Change]] = defaultdict(list)
        self._lock = threading.Lock()        # the in-memory record and the pending changes
        self._writing = threading.Lock()     # one conditional write at a time
        self.problem = ""
        try:
            self._shards = self._parse(store.read(self.key))
        except FileNotFoundError:
            pass
        except Exception as exc:  # unreadable: counts start from zero, and the run says why
            self._warn(f"{store.where(self.key)} unreadable ({type(exc).__name__}: {exc}): the attempt cap counts "
                       f"from this run")

    def _warn(self, problem: str) -> None:
        if problem != self.problem and self.log is not None:
            self.log.warning("run %s: attempt record: %s", self.run, problem)
        self.problem = problem

    @staticmethod
    def _parse(data: bytes | None) -> dict[str, ShardAttempts]:
        raw = json.loads(data) if data else {}
        return {name: ShardAttempts(**{k: v for k, v in entry.items() if k in ShardAttempts.__dataclass_fields__})
                for name, entry in raw.items() if isinstance(entry, dict)}

    def get(self, shard: int) -> ShardAttempts:
        """A copy of `shard`'s history (all zero for a shard that never failed)."""
        with self._lock:
            found = self._shards.get(shard_dir_name(shard, self.num_shards))
            return ShardAttempts(**asdict(found)) if found else ShardAttempts()

    def known(self) -> list[int]:
        """The shards of this shard count the record holds anything about."""
        with self._lock:
            return sorted(s for s in range(self.num_shards) if shard_dir_name(s, self.num_shards) in self._shards)

    # --- changes ----------------------------------------------------------------------------------------------
    def failed(self, shard: int, host: str, error: str, count: bool = True) -> None:
        """`shard` failed on `host` for `error`: one more failure, unless `count` is False (a mistake a re-run
        cannot fix burns no attempt)."""
        def change(entry: ShardAttempts) -> None:
            entry.failed_attempts += 1 if count else 0
            entry.last_failed_host, entry.last_error = host, one_line(error)
        self._change(shard, change)

    def forgive(self, shards: list[int]) -> None:
        """Take back one counted failure of each of `shards` (found afterwards to be a mistake no re-run fixes)."""
        def change(entry: ShardAttempts) -> None:
            entry.failed_attempts = max(0, entry.failed_attempts - 1)
        for shard in shards:
            self._change(shard, change, write=False)
        self.write()

    def ended(self, shard: int, row: dict) -> None:
        """How a run left `shard`: its table row (state, host, GPU, samples...), shown by later runs' tables."""
        def change(entry: ShardAttempts) -> None:
            entry.last = dict(row)
        self._change(shard, change)

    def reset(self, shards: list[int]) -> None:
        """Failure counts of `shards` back to zero (`reset_attempts`); the last failing host stays known."""
        def change(entry: ShardAttempts) -> None:
            entry.failed_attempts = 0
        for shard in shards:
            self._change(shard, change, write=False)
        self.write()

    def _change(self, shard: int, change: Change, write: bool = True) -> None:
        name = shard_dir_name(shard, self.num_shards)
        with self._lock:
            change(self._shards.setdefault(name, ShardAttempts()))
            self._pending[name].append(change)
        if write:
            self.write()

    def write(self) -> None:
        """Apply the pending changes to the stored record with a conditional write (read, change, put if
        unchanged; again on a race). A change another thread made meanwhile goes out with this one."""
        if not self.reachable():
            self._warn(f"{self.store.where(self.key)} is not visible from the orchestrator (a file:// output only "
                       f"the hosts see): failures are counted for this run only")
            return
        with self._writing:
            with self._lock:
                pending, self._pending = self._pending, defaultdict(list)
            if not pending:
                return

            def apply(data: bytes | None) -> bytes:
                shards = self._parse(data)
                for name, changes in pending.items():
                    for change in changes:
                        change(shards.setdefault(name, ShardAttempts()))
                return json.dumps({name: asdict(entry) for name, entry in sorted(shards.items())},
                                  separators=(",", ":")).encode()

            try:
                written = self.store.update(self.key, apply)
            except Exception as exc:  # the run goes on; the changes wait for the next write, and it says so
                with self._lock:
                    for name, changes in pending.items():
                        self._pending[name][:0] = changes
                self._warn(f"{self.store.where(self.key)} not written yet ({type(exc).__name__}: {exc}): tried "
                           f"again with the next change and at the end of the run")
                return
            with self._lock:  # the stored record (other runs' changes included), plus what came in meanwhile
                self._shards = self._parse(written)
                for name, changes in self._pending.items():
                    for change in changes:
                        change(self._shards.setdefault(name, ShardAttempts()))
