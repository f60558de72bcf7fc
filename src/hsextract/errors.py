"""Exception types of the worker. User-facing problems are `UsageError` (a `ValueError`)."""

from __future__ import annotations


class HsExtractError(Exception):
    """Root of every error the worker raises on purpose."""


class UsageError(HsExtractError, ValueError):
    """Bad arguments or inputs, detected before any work: the message names what was wrong."""


class ShardIncomplete(HsExtractError):
    """The shard ended without every assigned sample written or skipped."""


class Interrupted(HsExtractError):
    """A signal asked the worker to stop; finished files are journaled, nothing partial is kept."""

    def __init__(self, signame: str):
        super().__init__(f"interrupted by {signame}")
        self.signame = signame
