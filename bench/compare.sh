#!/usr/bin/env bash
# Before/after in one device call: the same bench/run_on_device.sh steps on another checkout (e.g. main before a change,
# exported with `git archive REV | tar -x -C .before`, carried) and on this one, alternating step by step so that both
# see the same machine. Each side's output goes to $OUT/before and $OUT/after (packed into $OUT/compare.tgz), the
# summary to $OUT/compare.txt. ROUNDS=N repeats the whole alternation N times ($OUT/round<r>/before, .../after), since
# one run a side can differ by more than the change (workload 2 moves by a few percent between runs of one build).
#   bash bench/compare.sh .before decode throughput_fp8 throughput
#   ROUNDS=2 BENCH_WARMUP_REQUESTS=32 BENCH_QUANTIZATION=int4 bash bench/compare.sh .before throughput
set -u
other=$1
shift
OUT=${OUT:-/tmp/out}
rounds=${ROUNDS:-1}
[ -e "$other/.whl" ] || ln -s "$PWD/.whl" "$other/.whl"
[ -e "$other/.data" ] || ln -s "$PWD/.data" "$other/.data"
for r in $(seq 1 "$rounds"); do
  sub=$([ "$rounds" -gt 1 ] && echo "round$r/" || true)
  for step in "$@"; do
    (cd "$other" && OUT="$OUT/${sub}before" bash bench/run_on_device.sh "$step")
    OUT="$OUT/${sub}after" bash bench/run_on_device.sh "$step"
  done
done
python3 - "$OUT" <<'EOF_PY' | tee "$OUT/compare.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(side, name):
  path = side / name
  return json.loads(path.read_text()) if path.exists() else None
print("| measurement | before | after | after / before |\n| --- | --- | --- | --- |")
for base in sorted({p.parent.parent for p in out.glob("**/before/bench_*.json")}):
  tag = f"{base.name} " if base != out else ""
  for name in sorted({p.name for p in base.glob("*/bench_*.json")}):
    before, after = load(base / "before", name), load(base / "after", name)
    if before is None or after is None: continue
    if "rows" in before:   # decode: tok/s per prompt length
      for b, a in zip(before["rows"], after["rows"]):
        print(f"| {tag}{name} prompt {b['prompt_len']}: decode tok/s | {b['decode_tok_s']:,.0f} | {a['decode_tok_s']:,.0f} | "
              f"{a['decode_tok_s'] / b['decode_tok_s']:.3f} |")
    elif "output_tok_s" in before:
      print(f"| {tag}{name}: output tok/s | {before['output_tok_s']:,.0f} | {after['output_tok_s']:,.0f} | "
            f"{after['output_tok_s'] / before['output_tok_s']:.3f} |")
EOF_PY
tops=$([ "$rounds" -gt 1 ] && seq -f "round%g" 1 "$rounds" || echo before after)
tar czf "$OUT/compare.tgz" -C "$OUT" $tops && (cd "$OUT" && rm -rf $tops)
