#!/usr/bin/env bash
# Before/after in one device call: the same bench/run_on_device.sh steps on another checkout (e.g. main before a change,
# exported with `git archive REV | tar -x -C .before`, carried) and on this one, alternating step by step so that both
# see the same machine. Each side's output goes to $OUT/before and $OUT/after (packed into $OUT/compare.tgz), the
# summary to $OUT/compare.txt.
#   bash bench/compare.sh .before decode throughput_fp8 throughput
set -u
other=$1
shift
OUT=${OUT:-/tmp/out}
[ -e "$other/.whl" ] || ln -s "$PWD/.whl" "$other/.whl"
[ -e "$other/.data" ] || ln -s "$PWD/.data" "$other/.data"
for step in "$@"; do
  (cd "$other" && OUT="$OUT/before" bash bench/run_on_device.sh "$step")
  OUT="$OUT/after" bash bench/run_on_device.sh "$step"
done
python3 - "$OUT" <<'EOF' | tee "$OUT/compare.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(side, name):
  path = out / side / name
  return json.loads(path.read_text()) if path.exists() else None
print("| measurement | before | after | after / before |\n| --- | --- | --- | --- |")
for name in sorted({p.name for p in out.glob("*/bench_*.json")}):
  before, after = load("before", name), load("after", name)
  if before is None or after is None: continue
  if "rows" in before:   # decode: tok/s per prompt length
    for b, a in zip(before["rows"], after["rows"]):
      print(f"| {name} prompt {b['prompt_len']}: decode tok/s | {b['decode_tok_s']:,.0f} | {a['decode_tok_s']:,.0f} | "
            f"{a['decode_tok_s'] / b['decode_tok_s']:.3f} |")
  elif "output_tok_s" in before:
    print(f"| {name}: output tok/s | {before['output_tok_s']:,.0f} | {after['output_tok_s']:,.0f} | "
          f"{after['output_tok_s'] / before['output_tok_s']:.3f} |")
EOF
tar czf "$OUT/compare.tgz" -C "$OUT" before after && rm -rf "$OUT/before" "$OUT/after"
