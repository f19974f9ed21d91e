#!/usr/bin/env bash
# Packed (quantized) experts on the GPU in one device call (docs/benchmarks.md, section 12): the Qwen3-30B-A3B shape's
# sparse layer with int8 / int4 / FP8 experts against the portable path (bench/check_moe_packed.py), then
# bench/moe_bench.py's parts with bf16 weights and each format quantized at load, the formats alternating round by round.
#   bash bench/moe_quant_on_device.sh                  (MOE_QUANT_STEPS="check decode" by default)
#   ROUNDS=2 MOE_QUANT_FORMATS="none fp8" MOE_QUANT_STEPS=throughput MOE_KV_GIB=40 bash bench/moe_quant_on_device.sh
# Each run's JSON is $OUT/moe_<part>_<format>_r<round>.json ("none" = bf16), one line a run in $OUT/moe_quant.txt.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD DEV=CUDA OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
failed=0
for step in ${MOE_QUANT_STEPS:-check decode}; do
  echo "=== $step $(date -u +%FT%TZ)"
  case $step in
    check) python3 bench/check_moe_packed.py || failed=1 ;;
    decode|throughput)
      for r in $(seq 1 "${ROUNDS:-1}"); do
        for q in ${MOE_QUANT_FORMATS:-none int8 int4 fp8}; do
          if [ "$q" = none ]; then python3 bench/moe_bench.py "$step" || failed=1; saved="$OUT/moe_$step.json"
          else python3 bench/moe_bench.py "$step" --quantization "$q" || failed=1; saved="$OUT/moe_${step}_$q.json"; fi
          [ -f "$saved" ] && mv "$saved" "$OUT/moe_${step}_${q}_r$r.json"
          python3 - "$OUT/moe_${step}_${q}_r$r.json" "$step $q round $r" >> "$OUT/moe_quant.txt" <<'EOF_PY'
import json, sys
from pathlib import Path
path, label = sys.argv[1:]
run = json.loads(Path(path).read_text()) if Path(path).exists() else {}
rate = run.get("decode_tok_s", run.get("output_tok_s"))
print(f"{label}: {rate:,.1f} tok/s, load {run['load_s']:.1f} s" if rate else f"{label}: no result")
EOF_PY
        done
      done ;;
  esac
done
cat "$OUT/moe_quant.txt" 2>/dev/null
exit $failed
