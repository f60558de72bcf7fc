"""The real worker with faults injected into its model's forward pass, for tests and the fault matrix.

    python -m harness.faulty extract --model ... (the arguments of `hsextract extract`)

runs `hsextract.cli.main` with a `capture` (the worker's seam for the model) whose forward pass obeys:
  HSX_HOLD_WHILE=PATH        before each forward pass, wait while PATH exists: a shard held alive and
                             heartbeating, mid-run, for as long as a test needs
  HSX_OOM_ABOVE_TOKENS=N     a forward pass over more than N padded tokens raises torch.OutOfMemoryError
  HSX_FAIL_WITH=TEXT         every forward pass raises RuntimeError(TEXT): a bug that fails every shard alike
  HSX_FORWARD_DELAY_S=S      every forward pass takes S seconds longer: a slow GPU, so a shard runs long
                             enough for a test to act on it mid-run however fast this machine is
`python_for(path, env)` writes an interpreter that passes deploy's checks and runs this when asked to extract.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HOLD_WHILE = "HSX_HOLD_WHILE"
OOM_ABOVE_TOKENS = "HSX_OOM_ABOVE_TOKENS"
FAIL_WITH = "HSX_FAIL_WITH"
FORWARD_DELAY_S = "HSX_FORWARD_DELAY_S"


def faulty_capture(*args, **kwargs):
    """A `LayerCapture` whose `run` holds, runs out of memory or fails as the environment says."""
    import torch

    from hsextract.run.capture import LayerCapture

    class FaultyCapture(LayerCapture):
        def run(self, input_ids: list[list[int]]):
            while os.environ.get(HOLD_WHILE) and os.path.exists(os.environ[HOLD_WHILE]):
                time.sleep(0.1)
            if os.environ.get(FORWARD_DELAY_S):
                time.sleep(float(os.environ[FORWARD_DELAY_S]))
            if os.environ.get(FAIL_WITH):
                raise RuntimeError(os.environ[FAIL_WITH])
            limit = os.environ.get(OOM_ABOVE_TOKENS)
            padded = max(len(ids) for ids in input_ids) * len(input_ids)
            if limit is not None and padded > int(limit):
                raise torch.OutOfMemoryError(f"injected by {OOM_ABOVE_TOKENS}={limit} ({padded} padded tokens)")
            return super().run(input_ids)

    return FaultyCapture(*args, **kwargs)


def python_for(path: Path, env: dict[str, str], real: str = sys.executable) -> str:
    """An interpreter at `path`: like `real` for everything but `-m hsextract extract ...`, which it runs as
    `-m harness.faulty extract ...` with `env` exported (what a launch runs: see tasks/launch.sh)."""
    exports = "".join(f"export {name}='{value}'\n" for name, value in env.items())
    path.write_text(f"#!/bin/sh\nif [ \"$1 $2 $3\" = '-m hsextract extract' ]; then\n{exports}shift 2\n"
                    f"exec {real} -m harness.faulty \"$@\"\nfi\nexec {real} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


if __name__ == "__main__":
    from hsextract import cli

    cli.run(sys.argv[1:], capture=faulty_capture)
