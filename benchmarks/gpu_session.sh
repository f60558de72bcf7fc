#!/bin/bash
# The GPU measurements of issue 20, in parts that each fit one device call (10 minutes), on one machine:
#   bash benchmarks/gpu_session.sh 1   # the 32-layer table, bf16 and fp8 side by side, 2000 samples (~7.5 min)
#   bash benchmarks/gpu_session.sh 2   # correctness; 64 layers: bare forward MFU, torch.compile beside it (~8 min)
#   bash benchmarks/gpu_session.sh 3   # model load against a raw read (40 layers, ~34 GB); the 8-layer table (~7 min)
# Needs flash-linear-attention and fla-core 0.6.0 as wheels in .whl/ (carried to the device); writes its logs
# and JSON to $OUT (default ./gpu-out). Every figure of a part comes from the one machine that ran it.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || { echo "cannot install the wheels in .whl/"; exit 1; }
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
quiet() { grep --line-buffered -v "Warning\|warn(\|Writing model\|Loading weights"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
          'triton', triton.__version__)"
case "$1" in
1)
    timeout 560 python3 benchmarks/gpu_throughput.py --fp8 --ceiling-batches 24 --naive-samples 5 \
        --json "$OUT/tp32.json" 2>&1 | quiet | tee "$OUT/tp32.log" ;;
2)
    timeout 200 python3 benchmarks/gpu_correctness.py --samples 32 2>&1 | quiet | tail -8 | tee "$OUT/correct.log"
    timeout 360 python3 benchmarks/gpu_throughput.py --model-layers 64 --bare-only --compile --ceiling-batches 16 \
        --json "$OUT/tp64.json" 2>&1 | quiet | tee "$OUT/tp64.log" ;;
3)
    timeout 330 python3 benchmarks/model_load.py --model-layers 40 2>&1 | quiet | tee "$OUT/load.log"
    timeout 240 python3 benchmarks/gpu_throughput.py --model-layers 8 --samples 1000 --naive-samples 5 \
        --json "$OUT/tp8.json" 2>&1 | quiet | tee "$OUT/tp8.log" ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh 1|2|3"; exit 2 ;;
esac
