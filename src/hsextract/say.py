"""The worker's one voice on stderr: every line it says starts `hsextract: shard i/n:` (what the supervisor shows
as "it printed last", and what a person reads in worker.log). One logger, `hsextract.worker`, not passed on to
the root logger; its lines go to whatever `sys.stderr` is when they are said (a redirect, a test's capture),
each flushed at once."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "hsextract.worker"


class _Stderr(logging.Handler):
    """Each record as one line on the current `sys.stderr`, flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's own rule: a line that cannot be said never stops the worker
            self.handleError(record)


def _logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


class ShardLog(logging.LoggerAdapter):
    """The logger of one shard: `info`, `warning` (its text starts `warning:`), `error`, each line prefixed."""

    def process(self, msg, kwargs):
        return f"hsextract: shard {self.extra['shard']}/{self.extra['num_shards']}: {msg}", kwargs


def shard_log(shard: int, num_shards: int) -> ShardLog:
    """What shard `shard` of `num_shards` says on stderr."""
    return ShardLog(_logger(), {"shard": shard, "num_shards": num_shards})
