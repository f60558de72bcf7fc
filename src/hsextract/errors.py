"""Exception types of the worker, and its exit codes. User-facing problems are `UsageError` (a `ValueError`).

Exit codes of `hsextract extract`: 0 the shard is complete; 2 bad arguments or inputs (`UsageError`: fix
them, a retry cannot help); 3 the shard ended incomplete; 75 the shard is being written by another process
(`ShardBusy`: try later); 128 + N stopped by signal N; 1 anything else.
"""

from __future__ import annotations


class HsExtractError(Exception):
    """Root of every error the worker raises on purpose."""


class UsageError(HsExtractError, ValueError):
    """Bad arguments or inputs, detected before any work: the message names what was wrong."""


class CorruptOutput(HsExtractError, ValueError):
    """A batch file (or journal) of an output is not what its journal recorded: truncated, altered or gone. The
    message names the output, shard and file, what differs, and the repair (`hsextract fsck OUTPUT --repair`)."""


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
