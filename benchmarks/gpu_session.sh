#!/bin/bash
# The GPU measurements of issue 20, in parts that each fit one device call (10 minutes), on one machine:
#   bash benchmarks/gpu_session.sh 1   # the 32-layer table: the bf16 worker, the GPU ceiling over all the
#                                      # run's batches, clocks and power per phase (~8 min)
#   bash benchmarks/gpu_session.sh 7   # after 1 on the same machine: the fp8 worker over the same data (its
#                                      # ratios from part 1's ceilings: fp8_ratios.py), then correctness (~8 min)
#   bash benchmarks/gpu_session.sh 2   # correctness with the worker's kernels; the 64-layer bare forward's MFU
#   bash benchmarks/gpu_session.sh 3   # model load against a raw read (32 layers, ~27 GB), tuned host or not;
#                                      # saves the Triton cache it tuned ($OUT/triton-cache.tgz; TRITON_TGZ=it
#                                      # seeds a later part 3 on the same kind of GPU)
#   bash benchmarks/gpu_session.sh 10  # correctness (preloaded weights vs transformers' load too), then part 9
#   bash benchmarks/gpu_session.sh 11  # correctness, then the model load at 64 layers (TRITON_TGZ: seeded cache;
#                                      # CORRECT_S, LOAD_S: their time limits; ~480 s seeded)
#   bash benchmarks/gpu_session.sh 4   # the 8-layer table (the disk is the ceiling there)
#   bash benchmarks/gpu_session.sh 5   # torch.compile of every decoder layer's MLP beside the bare forward (32
#                                      # layers; whole layers did not finish compiling in 490 s: RESULTS.md)
#   bash benchmarks/gpu_session.sh 6   # the preflight's GPU facts (nvidia-smi, parsed as the preflight does)
#   bash benchmarks/gpu_session.sh 9   # the worker's imports and steps before its load, timed (startup_imports.py)
#   bash benchmarks/gpu_session.sh 12  # the 64-layer profile table and the levers of issue 40 (gpu_profile.py)
#   bash benchmarks/gpu_session.sh 13  # the fused kernels' correctness and error vs fp32, the 32-layer worker on them
#   bash benchmarks/gpu_session.sh 14  # issue 38's state checks: the 32-layer worker with and without them; the profile
#                                      # table before and after `fused` (64 layers); the preflight's GPU facts
#   bash benchmarks/gpu_session.sh 15  # issue 38: the readers' checksum check, in-process, on the device's 16 cores
#   bash benchmarks/gpu_session.sh 8   # the host syncs in a forward; the bare forward with the worker's masks made
#                                      # once and with the model's own; quiet, beside the worker's host work, quiet
#                                      # again (~5 min)
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
# the GPU's clocks, power and busy share every half second, summed up per phase of the benchmarks (throttling?)
SMI_FIELDS=timestamp,clocks.sm,power.draw,utilization.gpu,temperature.gpu
nvidia-smi --query-gpu=$SMI_FIELDS,clocks_event_reasons.active --format=csv >/dev/null 2>&1 \
    && SMI_FIELDS=$SMI_FIELDS,clocks_event_reasons.active
nvidia-smi --query-gpu=$SMI_FIELDS --format=csv,noheader,nounits -lms 500 >"$OUT/smi.csv" 2>/dev/null &
SMI=$!
clocks() {  # clocks <benchmark json>: per phase, the mean SM clock, power, busy share and the throttle reasons seen
    kill $SMI 2>/dev/null
    python3 - "$OUT/smi.csv" "$1" <<'PY'
import collections, datetime, json, sys
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(f[1]), float(f[2]), float(f[3]), float(f[4]), f[5] if len(f) > 5 else ""))
    except (ValueError, IndexError):
        pass
for name, t0, t1 in json.load(open(sys.argv[2])).get("phases", []):
    sel = [r for r in rows if t0 <= r[0] <= t1]
    if sel:
        n = len(sel)
        reasons = collections.Counter(r[5] for r in sel).most_common(3)
        print(f"GPU during {name} ({t1 - t0:.0f}s, {n} samples): SM clock {sum(r[1] for r in sel) / n:.0f} MHz "
              f"(min {min(r[1] for r in sel):.0f}), power {sum(r[2] for r in sel) / n:.0f} W, busy "
              f"{sum(r[3] for r in sel) / n:.1f}%, {max(r[4] for r in sel):.0f} C; throttle reasons {reasons}")
PY
}
case "$1" in
1)
    timeout 580 python3 benchmarks/gpu_throughput.py --sustained --no-reference --ceiling-batches 24 \
        --naive-samples 3 --json "$OUT/tp32.json" 2>&1 | quiet | tee "$OUT/tp32.log"
    clocks "$OUT/tp32.json" | tee -a "$OUT/tp32.log" ;;
7)
    timeout 330 python3 benchmarks/gpu_throughput.py --worker-only --fp8-only --json "$OUT/fp8.json" 2>&1 | quiet \
        | tee "$OUT/fp8.log"
    clocks "$OUT/fp8.json" | tee -a "$OUT/fp8.log"
    timeout 240 python3 benchmarks/gpu_correctness.py --samples 32 2>&1 | quiet | tee "$OUT/correct-full.log" \
        | grep "model loaded\|kernels warmed" | tail -2; tail -8 "$OUT/correct-full.log" | tee "$OUT/correct.log" ;;
2)
    timeout 240 python3 benchmarks/gpu_correctness.py --samples 32 2>&1 | quiet | tee "$OUT/correct-full.log" \
        | grep "model loaded\|kernels warmed" | tail -2; tail -8 "$OUT/correct-full.log" | tee "$OUT/correct.log"
    timeout 300 python3 benchmarks/gpu_throughput.py --model-layers 64 --bare-only --no-reference \
        --ceiling-batches 12 --json "$OUT/tp64.json" 2>&1 | quiet | tee "$OUT/tp64.log" ;;
3)  # with TRITON_TGZ=<a tarball part 3 saved on this kind of GPU>: a tuned host from the start, no untuned run
    rm -rf /tmp/hsx-load-*  # a checkpoint a failed run left
    timeout 560 python3 benchmarks/model_load.py --model-layers ${MODEL_LAYERS:-32} \
        ${TRITON_TGZ:+--triton-cache "$TRITON_TGZ"} \
        --save-triton-cache "$OUT/triton-cache.tgz" 2>&1 | quiet | tee "$OUT/load.log" ;;
11)  # correctness (part 10's), then a 64-layer model load from a seeded Triton cache, within one call
    [ "${CORRECT_S:-200}" -gt 0 ] && { timeout ${CORRECT_S:-200} python3 benchmarks/gpu_correctness.py --samples 32 2>&1 \
        | quiet | tee "$OUT/correct-full.log" \
        | grep "model loaded\|kernels warmed\|preload\|differ" | tail -5; tail -8 "$OUT/correct-full.log" \
        | tee "$OUT/correct.log"; }
    rm -rf /tmp/hsx-load-*
    timeout ${LOAD_S:-420} python3 benchmarks/model_load.py --model-layers 64 --quick --all-cached \
        ${MAX_RUNS:+--max-runs $MAX_RUNS} \
        ${TRITON_TGZ:+--triton-cache "$TRITON_TGZ"} \
        2>&1 | quiet | tee "$OUT/load64.log" ;;
10)
    timeout 300 python3 benchmarks/gpu_correctness.py --samples 32 2>&1 | quiet | tee "$OUT/correct-full.log" \
        | grep "model loaded\|kernels warmed\|preload\|differ" | tail -5; tail -8 "$OUT/correct-full.log" \
        | tee "$OUT/correct.log"
    timeout 200 python3 benchmarks/startup_imports.py 2>&1 | quiet | tee "$OUT/imports.log" ;;
4)
    timeout 560 python3 benchmarks/gpu_throughput.py --model-layers 8 --samples 1000 --naive-samples 5 \
        --json "$OUT/tp8.json" 2>&1 | quiet | tee "$OUT/tp8.log"
    clocks "$OUT/tp8.json" | tee -a "$OUT/tp8.log" ;;
5)
    TORCH_LOGS=recompiles timeout 540 python3 benchmarks/gpu_throughput.py --bare-only --compile mlp --no-reference \
        --ceiling-batches 16 \
        --json "$OUT/compile.json" 2>&1 | quiet | tee "$OUT/compile.log" ;;
6)  # the preflight's GPU facts on a real GPU: nvidia-smi's lines as tasks/commands.py parses them
    PYTHONPATH=src:.:/tmp/site python3 -c "
import subprocess
from tasks.commands import facts_cmd, parse_facts
out = subprocess.run(['sh', '-c', facts_cmd('/tmp/hsx-w', '/tmp')], capture_output=True, text=True).stdout
print(out); print(parse_facts(out))" 2>&1 | tee "$OUT/facts.log" ;;
8)
    timeout 400 python3 benchmarks/gpu_throughput.py --bare-only --no-reference --host-load --ceiling-batches 48 \
        --json "$OUT/load.json" 2>&1 | quiet | tee "$OUT/hostload.log"
    clocks "$OUT/load.json" | tee -a "$OUT/hostload.log" ;;
9)
    timeout 300 python3 benchmarks/startup_imports.py 2>&1 | quiet | tee "$OUT/imports.log" ;;
13)  # issue 40: the fused kernels checked (the tiny worker against its references; 12 layers of the 27B shape
     # against fp32, default and fused side by side), then the 32-layer worker on them against its own GPU ceiling
    [ "${CORRECT_S:-120}" -gt 0 ] && timeout ${CORRECT_S:-120} python3 benchmarks/gpu_correctness.py --samples 24 \
        --kernels fused --no-preload-check \
        2>&1 | quiet | tee "$OUT/correct-full.log" | grep "kernels\|equal\|differ" | tail -4
    tail -7 "$OUT/correct-full.log"
    [ "${ERR_S:-100}" -gt 0 ] && timeout ${ERR_S:-100} python3 benchmarks/gpu_correctness.py --shape27b ${ERR_LAYERS:-12} \
        --samples 4 2>&1 | quiet | tee "$OUT/err27b.log"
    [ "${TP_S:-330}" -gt 0 ] && timeout ${TP_S:-330} python3 benchmarks/gpu_throughput.py --kernels fused --sustained --no-reference --no-sink \
        --naive-samples 0 --samples ${SAMPLES:-600} --ceiling-batches 12 --fp8 --json "$OUT/tp32f.json" 2>&1 | quiet \
        | tee "$OUT/tp32f.log" | tail -25 ;;
14)  # issue 38's state checks: alone on one batch, then the 32-layer bf16 worker with and without them, alternated
     # after a warm-up run (AB_S, AB: pairs); then
     # issue 40's profile table before and after `fused` at 64 layers (PROFILE_S), then the preflight's GPU facts
    PYTHONPATH=src:benchmarks:/tmp/site timeout 60 python3 benchmarks/state_checks_micro.py 2>&1 | quiet \
        | tee "$OUT/micro.log"
    [ "${AB_S:-240}" -gt 0 ] && timeout ${AB_S:-240} python3 benchmarks/gpu_throughput.py --worker-only \
        --state-checks-ab ${AB:-2} --kernels ${AB_KERNELS:-default} --samples ${SAMPLES:-400} --json "$OUT/ab.json" \
        2>&1 | quiet | tee "$OUT/ab.log" | grep "^worker\|^state\|model + data"
    [ "${PROFILE_S:-300}" -gt 0 ] && timeout ${PROFILE_S:-300} python3 benchmarks/gpu_profile.py --model-layers 64 \
        --levers fused --deadline 150 --json "$OUT/profile.json" 2>&1 | quiet | tee "$OUT/profile.log"
    gzip -f "$OUT"/trace-*.json 2>/dev/null
    PYTHONPATH=src:.:/tmp/site python3 -c "
import subprocess
from tasks.commands import facts_cmd, parse_facts
out = subprocess.run(['sh', '-c', facts_cmd('/tmp/hsx-w', '/tmp')], capture_output=True, text=True).stdout
print(out); print(parse_facts(out))" 2>&1 | tee "$OUT/facts.log" ;;
15)  # issue 38: the readers' checksum check on a machine with spare cores (16 here; this repo's CPU machine has 2,
     # where the hash thread, 9 GB/s with its page faults, is slower than the consumer's copy on the other core)
    # HASH_S=0: no hash_paths.py; PREFETCHES, STREAM_ARGS (e.g. "--epochs 1 --files 24 --cold": a first epoch
    # from the disk too): stream_read.py's runs
    [ "${HASH_S:-150}" -gt 0 ] && PYTHONPATH=src:/tmp/site timeout ${HASH_S:-150} python3 benchmarks/hash_paths.py \
        --repeats 2 2>&1 | quiet | tee "$OUT/hash.log" | tail -9
    [ "${READ_S:-120}" -gt 0 ] && for prefetch in ${PREFETCHES:-2 4}; do
        PYTHONPATH=src:/tmp/site timeout ${READ_S:-120} python3 benchmarks/stream_read.py --no-s3 --workers 0 \
            ${STREAM_ARGS:---epochs 4} --prefetch $prefetch 2>&1 | quiet | grep '"where"' | tee -a "$OUT/read.log"
    done ;;
12)  # issue 40: the 64-layer profile table and every lever beside the baseline (LEVERS: which; default all)
    timeout ${PROFILE_S:-570} python3 benchmarks/gpu_profile.py --model-layers ${MODEL_LAYERS:-64} \
        --levers ${LEVERS:-all} --deadline ${DEADLINE_S:-470} --json "$OUT/profile.json" 2>&1 | quiet \
        | tee "$OUT/profile.log"
    gzip -f "$OUT"/trace-*.json 2>/dev/null ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh 1|2|3|4|5|6|7|8|9|10|11|12|13|14|15"; exit 2 ;;
esac
kill $SMI 2>/dev/null || true  # clocks() may have stopped it already
