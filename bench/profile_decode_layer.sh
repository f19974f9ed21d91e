#!/usr/bin/env bash
# Nsight Compute on the persistent decode-layer kernel: its first launch in a short engine decode (Qwen3-0.6B's
# 28 layers, random weights, a 300-token prompt in the smallest context bucket; no decode sizes captured at start-up,
# so the first launch is the first real decode step): warp states, scheduler statistics and the SASS lines where warps
# stall most. PROFILE_BATCH sets the batch (default 1).
#   bash bench/profile_decode_layer.sh      (on the GPU machine; writes $OUT/decode_layer_ncu_b<batch>.txt)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD DEV=CUDA OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
batch=${PROFILE_BATCH:-1} report="$OUT/decode_layer_ncu_b${PROFILE_BATCH:-1}.txt"
ncu --clock-control none -k regex:tv_decode_layer --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section SourceCounters --section LaunchStats --section Occupancy \
    --print-details all python3 main.py bench decode --model qwen3-0.6b --load-format dummy --dtype bfloat16 \
    --max-model-len 4096 --max-num-seqs "$batch" --kv-cache-memory 2 --cuda-graph-sizes --batch-size "$batch" --prompt-len 300 \
    --max-tokens 32 > "$report" 2>&1
grep -v "^\[tinyvllm\]" "$report" | grep -A400 "tv_decode_layer" | head -150
