#!/usr/bin/env bash
# Tensor parallelism's kernels checked and its batch-1 decode timed against another checkout's code, in one call on a
# kind with several GPUs: bench/tp_check.py's all-reduce checks (the kernel's bits against the copies and adds, both
# protocols' sizes, a step's back-to-back broadcasts) and stories260K split over TP GPUs, each under a time limit (a
# collective that never meets hangs), then bench/decode_ab.sh alternating the Qwen3-8B shape at TP=N and TP=1 with the
# other checkout, then bench/tp_overhead.py's PARTS (e.g. "no_all_reduce share"; default none) on this checkout.
# Results: $OUT/tp_check.txt, $OUT/decode_ab.txt, $OUT/tp_overhead.txt.
#   TP=2 bash bench/tp_ab.sh .before
set -u
other=$1
tp=${TP:-2}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
check() { timeout "${CHECK_LIMIT:-240}" python3 bench/tp_check.py --tp "$tp" "$@" >> "$OUT/tp_check.txt" 2>&1 || echo "$* FAILED ($?)" >> "$OUT/tp_check.txt"; }
check --only all_reduce
check --only stories --stories .data/stories260K-hf
grep -h "FAILED\|\"equal\"" "$OUT/tp_check.txt" | cut -c1-300
grep -q FAILED "$OUT/tp_check.txt" && exit 1
bash bench/decode_ab.sh "$other" "qwen3-8b -tp $tp" "qwen3-8b"
for part in ${PARTS:-}; do
  echo "$part: $(python3 bench/tp_overhead.py --tp "$tp" --part "$part" 2>&1 | grep "decode .* tok/s" | tail -1)" | tee -a "$OUT/tp_overhead.txt"
done
