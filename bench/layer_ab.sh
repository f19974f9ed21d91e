#!/usr/bin/env bash
# The persistent decode-layer kernel of other checkouts (e.g. branches exported with `git archive REV | tar -x -C .b1`,
# carried) against this one in one device call: each other checkout's GPU check (bench/check_decode_layer.py without
# its engine part), then the batch-1 verification and decode steps' GPU time (bench/spec_bench.py --parts replay: graph
# replays, k = 4 and 3 proposals) in every checkout in turn, ROUNDS times, then decode steps of 1, 5 and 8 sequences
# (bench/replay_ab.sh: its "before" lines are the other checkouts, "after" this one). One line a run in
# $OUT/layer_ab.txt. CHECK=0 skips the GPU checks (a checkout whose layer kernel is already checked).
#   ROUNDS=2 bash bench/layer_ab.sh .b1,.b2
set -u
IFS=, read -r -a others <<< "$1"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export DEV=CUDA
summary=$OUT/layer_ab.txt
for other in "${others[@]}"; do
  [ -e "$other/.whl" ] || ln -s "$PWD/.whl" "$other/.whl"
  [ -e "$other/.data" ] || ln -s "$PWD/.data" "$other/.data"
  [ "${CHECK:-1}" = 0 ] && continue
  result=$(cd "$other" && PYTHONPATH="/tmp/site:$PWD" OUT="$OUT/check_$(basename "$other")" SKIP=engine \
           python3 bench/check_decode_layer.py 2>&1 | tail -1)
  echo "check $other: $result" | tee -a "$summary"
done
for r in $(seq 1 "${ROUNDS:-1}"); do
  for dir in . "${others[@]}"; do
    (cd "$dir" && PYTHONPATH="/tmp/site:$PWD" python3 bench/spec_bench.py --parts replay --verify-ks 4,3 2>/dev/null) |
      grep '"ratio"' | sed "s|^|round $r $dir: |" | tee -a "$summary"
  done
done
OUT=$OUT ROUNDS=1 bash bench/replay_ab.sh "$1" "qwen3-0.6b --batch 1" "qwen3-0.6b --batch 5" "qwen3-0.6b --batch 8"
cat "$OUT/replay_ab.txt" >> "$summary"
