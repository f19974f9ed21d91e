#!/usr/bin/env bash
# The GPU's decode step of several checkouts alternating with this one: each run captures a model's decode step and
# replays its graph back to back (bench/gpu_profile.py --replay-only), so that the host's pace, which moves the engine's
# own steps by 10-40% between runs on a shared machine, does not enter the comparison. Arguments as bench/decode_ab.sh's:
# the other checkouts (comma-separated), then "MODEL [FLAGS...]" specs (gpu_profile's flags: --quantization, --batch).
# Each line of $OUT/replay_ab.txt: the side, the spec and the breakdown (graph_replay_ms: the median round's step).
#   ROUNDS=2 bash bench/replay_ab.sh .before "llama-3.2-1b --quantization int4"
set -u
IFS=, read -r -a others <<< "$1"
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
replay() {   # side, dir, model and flags
  local side=$1 dir=$2 model=$3
  shift 3
  local line
  line=$(cd "$dir" && PYTHONPATH="/tmp/site:$PWD" python3 bench/gpu_profile.py --model "$model" --replay-only \
    --replay-rounds 5 "$@" 2>&1 | grep "step breakdown" | tail -1)
  echo "$side | $model $* | $line" | tee -a "$OUT/replay_ab.txt"
}
for _ in $(seq "${ROUNDS:-1}"); do
  for spec in "$@"; do
    read -r -a words <<< "$spec"
    for other in "${others[@]}"; do
      side=before
      [ ${#others[@]} -gt 1 ] && side="before:$other"
      replay "$side" "$other" "${words[@]}"
    done
    replay after "$PWD" "${words[@]}"
  done
done
