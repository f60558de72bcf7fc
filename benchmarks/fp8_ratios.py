"""The fp8 worker's ratios to the GPU ceiling, from two runs on one machine (`gpu_session.sh 1`, then `7`):

    PYTHONPATH=src python3 benchmarks/fp8_ratios.py tp32.json fp8.json [--samples 2000] [--token-budget 8192]

`tp32.json` (gpu_throughput.py --sustained) holds the bare forward's rate and each batch's device time over all
the run's batches; `fp8.json` (gpu_throughput.py --worker-only --fp8-only) the fp8 worker over the same data.
The batches are rebuilt here from the same seed, so the steady state is judged against the bare forward over
exactly the batches after the fp8 worker's first file, as part 1 judges the bf16 worker. The sink is not the
ceiling at this depth: part 1 measured it for bf16's bytes per token, and fp8 writes about half of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


from gpu_throughput import batches, build_data, same_batches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tp32", type=Path)
    ap.add_argument("fp8", type=Path)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--token-budget", type=int, default=8192)
    args = ap.parse_args()
    ceiling = json.loads(args.tp32.read_text())
    fp8 = json.loads(args.fp8.read_text())["workers"]["--out-dtype fp8_e4m3"]
    with tempfile.TemporaryDirectory() as work:
        build_data(Path(work) / "data.jsonl", args.samples)
        every = batches(Path(work) / "data.jsonl", args.token_budget)
    if len(every) != len(ceiling["batch_s"]):
        raise SystemExit(f"{args.tp32} timed {len(ceiling['batch_s'])} batches; this data packs into {len(every)}: "
                         f"not the same run (--samples, --token-budget)")
    steady_ceiling = same_batches(every, ceiling["batch_s"], fp8["first_file_tokens"])
    print(f"fp8_e4m3 worker: {fp8['tokens_per_s']:,.0f} tok/s whole loop, {fp8['steady']:,.0f} steady; bare forward "
          f"{ceiling['bare']:,.0f} over all batches, {steady_ceiling:,.0f} over those after the first file")
    print(f"fp8_e4m3: worker / GPU ceiling = {fp8['tokens_per_s'] / ceiling['bare']:.3f} whole loop (goal >= 0.95), "
          f"{fp8['steady'] / steady_ceiling:.3f} steady, same batches (goal >= 0.98); "
          f"{fp8['tokens_per_s'] / ceiling['worker']:.2f}x the bf16 worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
