#!/usr/bin/env bash
# Batch-1 decode of several models and weight formats, the code of another checkout (e.g. main before a change, exported
# with `git archive REV | tar -x -C .before`) and this one alternating run by run, so that both see the same machine.
# Each argument is "MODEL [FLAGS...]" (e.g. "llama-3.2-1b -q int4", "qwen3-0.6b --no-decode-layer-kernel"); each line of
# $OUT/<MEASURE>_ab.txt is a side, the model and flags, and the run's result. ROUNDS (default 1): the whole alternation
# repeated, since one run's mean moves with the host's pace. Several other checkouts, comma-separated, alternate with
# this one in turn (each line names its directory). MEASURE:
#   decode  (default) the engine's own steps, `main.py bench decode` (mean tok/s, median step);
#   replay  the GPU's step alone: bench/gpu_profile.py --replay-only captures the decode step and replays its graph back
#           to back in five rounds (graph_replay_ms: the median round), free of the host's pace (bench/replay_ab.sh).
#   ROUNDS=2 bash bench/decode_ab.sh .before "llama-3.2-1b" "llama-3.2-1b -q int8"
set -u
IFS=, read -r -a others <<< "$1"
shift
OUT=${OUT:-/tmp/out}
MEASURE=${MEASURE:-decode}
mkdir -p "$OUT"
for other in "${others[@]}"; do
  [ -e "$other/.whl" ] || ln -s "$PWD/.whl" "$other/.whl"
  [ -e "$other/.data" ] || ln -s "$PWD/.data" "$other/.data"
done
decode() {   # model and flags: the bench's result line
  python3 main.py bench decode --model "$1" --load-format dummy --dtype bfloat16 --batch-size 1 --prompt-len 128 \
    --max-tokens 256 --kv-cache-memory 4 --cuda-graph-sizes 1 --max-num-seqs 4 "${@:2}" 2>&1 | grep "decode .* tok/s" | tail -1
}
replay() {   # model and flags: the step breakdown's line
  python3 bench/gpu_profile.py --model "$1" --replay-only --replay-rounds 5 "${@:2}" 2>&1 | grep "step breakdown" | tail -1
}
run() {   # side, dir, model and flags
  local side=$1 dir=$2 line
  shift 2
  line=$(cd "$dir" && PYTHONPATH="/tmp/site:$PWD" "$MEASURE" "$@")
  echo "$side | $* | $line" | tee -a "$OUT/${MEASURE}_ab.txt"
}
for _ in $(seq "${ROUNDS:-1}"); do
  for spec in "$@"; do
    read -r -a words <<< "$spec"
    for other in "${others[@]}"; do
      side=before
      [ ${#others[@]} -gt 1 ] && side="before:$other"
      run "$side" "$other" "${words[@]}"
    done
    run after "$PWD" "${words[@]}"
  done
done
