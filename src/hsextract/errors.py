"""Exception types of the worker, and its exit codes. User-facing problems are `UsageError` (a `ValueError`).

Exit codes of `hsextract extract`: 0 the shard is complete; 2 bad arguments or inputs (`UsageError`: fix
them, a retry cannot help); 3 the shard ended incomplete; 75 the shard is being written by another process
(`ShardBusy`: try later); 128 + N stopped by signal N; 1 anything else.
"""

from __future__ import annotations

import enum


class Retry(enum.Enum):
    """Whether trying again can help, said once where a failure is known and carried as it is from the worker's
    exit code to the flow's verdict (the orchestrator's exceptions and `tasks.failures.Failure` hold one too)."""

    NOW = "now"  # a blip (a connection reset, a store that did not answer): the same step again, at once
    LATER = "later"  # nothing known against it: the automation's re-run of the shard (under the attempt cap)
    NEVER = "never"  # a mistake in the inputs or the code (exit 2): the same again fails the same; a person fixes it


class HsExtractError(Exception):
    """Root of every error the worker raises on purpose; `retry` says whether trying again can help."""

    retry = Retry.LATER


class UsageError(HsExtractError, ValueError):
    """Bad arguments or inputs, detected before any work: the message names what was wrong."""

    retry = Retry.NEVER


class CorruptOutput(HsExtractError, ValueError):
    """A batch file (or journal) of an output is not what its journal recorded: truncated, altered or gone. The
    message names the output, shard and file, what differs, and the repair (`hsextract fsck OUTPUT --repair`)."""

    retry = Retry.NEVER


class DegenerateStates(UsageError):
    """A captured layer is all zeros, or constant, for every token of a batch: a broken kernel or checkpoint, not a
    bad sample. The shard stops before storing the batch (exit 2: a re-run computes the same)."""


class ShardBusy(HsExtractError):
    """Another live process holds the shard's lock: nothing is wrong with the inputs, try again later."""


class ShardIncomplete(HsExtractError):
    """The shard ended without every assigned sample written or skipped."""


class Interrupted(HsExtractError):
    """A signal asked the worker to stop; finished files are journaled, nothing partial is kept."""

    def __init__(self, signame: str):
        super().__init__(f"interrupted by {signame}")
        self.signame = signame


USAGE_EXIT = 2
BUSY_EXIT = 75  # EX_TEMPFAIL
