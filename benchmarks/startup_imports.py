"""Where a worker's start goes before its model loads: each import and step, timed in a fresh interpreter.

    PYTHONPATH=src python3 benchmarks/startup_imports.py [--runs 2]

Runs, in a new `python3` each time (`--runs` of them), the steps the worker takes before its load (with the
packages it hides hidden: `cli.hide_unused_packages`), in its order: torch, `torch.cuda.is_available`,
transformers, `AutoTokenizer` (the tokenizer path), the tiny tokenizer's load, the CUDA context (skipped without
a GPU), transformers' Qwen3.5 model code (with fla where installed), a 32-layer model of the 27B shape laid out
on the meta device, and the tuning thread's modules (`prewarm.standalone_modules`). Libraries are as cached
as the host has them: run it twice to see both. Then `python3 -X importtime` of the tokenizer and model
imports, the 25 costliest modules by their cumulative time (what pulls in sympy, scikit-learn, torch._dynamo...).
Figures: benchmarks/RESULTS.md, issue 20, sixth session.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path


STEPS = r"""
import sys, time
t0 = time.time()
def lap(what):
    global t0
    t = time.time(); print(f"  {what:<44} {t - t0:6.2f} s", flush=True); t0 = t
from hsextract.cli import hide_unused_packages
hide_unused_packages()  # as the worker does (scikit-learn)
import torch; lap("import torch")
cuda = torch.cuda.is_available(); lap("torch.cuda.is_available")
import transformers; lap("import transformers")
from transformers import AutoTokenizer; lap("from transformers import AutoTokenizer")
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True); lap("AutoTokenizer.from_pretrained (tiny)")
if cuda:
    torch.empty(1, device="cuda"); lap("CUDA context")
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(sys.argv[1]); lap("AutoConfig")
import transformers.models.qwen3_5.modeling_qwen3_5; lap("import modeling_qwen3_5 (fla where installed)")
with torch.device("meta"):
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
lap("32 layers on the meta device")
from pathlib import Path
from hsextract.run.prewarm import standalone_modules
standalone_modules(Path(sys.argv[1]), torch.device("cuda" if cuda else "cpu"), torch.bfloat16)
lap("the tuning thread's modules")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    from gpu_throughput import build_model

    model = build_model(Path(tempfile.mkdtemp(prefix="hsx-imports-")) / "model", 32)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    for run in range(args.runs):
        print(f"run {run + 1}:", flush=True)
        subprocess.run([sys.executable, "-c", STEPS, str(model)], env=env, check=True)
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "from hsextract.cli import hide_unused_packages; "
                          "hide_unused_packages(); import torch, transformers; from transformers "
                          "import AutoTokenizer; import transformers.models.qwen3_5.modeling_qwen3_5"],
                         env=env, capture_output=True, text=True)
    rows = []
    for line in out.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    print("costliest imports (cumulative, one process):")
    for micros, name in sorted(rows, reverse=True)[:25]:
        print(f"  {micros / 1e6:6.2f} s {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
