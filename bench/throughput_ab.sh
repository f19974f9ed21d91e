#!/usr/bin/env bash
# Workload 2 (docs/benchmarks.md, section 2, with a warm-up of 32 requests) for each weight format of QUANT_FORMATS
# ("none" = bf16), ROUNDS times, the formats alternating. With another checkout named (e.g. main before a change,
# exported with `git archive REV | tar -x -C .before`), it and this one alternate run by run (formats also in THIS_ONLY
# run on this checkout alone). One line a run in $OUT/throughput_ab.txt; each run's JSON and log in
# $OUT/throughput_ab.tgz (<side>-<format>-<round>/; one file back from the device). A format's first run on a fresh
# machine compiles its kernels at load and has come out slower: compare the later rounds.
#   ROUNDS=3 QUANT_FORMATS="none int8" THIS_ONLY=none bash bench/throughput_ab.sh .before
#   ROUNDS=2 QUANT_FORMATS="none int4 int8" bash bench/throughput_ab.sh
set -u
other=${1:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -n "$other" ]; then
  [ -e "$other/.whl" ] || ln -s "$PWD/.whl" "$other/.whl"
  [ -e "$other/.data" ] || ln -s "$PWD/.data" "$other/.data"
fi
failed=0
run() {   # side, checkout, format, round
  local out="$OUT/throughput_ab/$1-$3-$4" quant=()
  [ "$3" = none ] || quant=(BENCH_QUANTIZATION="$3")
  (cd "$2" && env OUT="$out" BENCH_WARMUP_REQUESTS=32 "${quant[@]}" bash bench/run_on_device.sh throughput) || failed=1
  python3 - "$out" "$1" "$3" "$4" >> "$OUT/throughput_ab.txt" <<'EOF_PY'
import json, sys
from pathlib import Path
out, side, q, r = sys.argv[1:]
files = list(Path(out).glob("bench_throughput*.json"))
run = json.loads(files[0].read_text()) if files else None
print(f"round {r} {side} {q}: " + (f"{run['output_tok_s']:,.0f} output tok/s ({run['seconds']:.2f} s)" if run else "no result"))
EOF_PY
}
for r in $(seq 1 "${ROUNDS:-1}"); do
  for q in ${QUANT_FORMATS:-none int8}; do
    [ -z "$other" ] || [[ " ${THIS_ONLY:-} " == *" $q "* ]] || run before "$other" "$q" "$r"
    run "$([ -n "$other" ] && echo after || echo this)" "$PWD" "$q" "$r"
  done
done
tar czf "$OUT/throughput_ab.tgz" -C "$OUT" throughput_ab && rm -rf "$OUT/throughput_ab"
cat "$OUT/throughput_ab.txt"
exit $failed
