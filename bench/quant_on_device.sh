#!/usr/bin/env bash
# Weight quantization on the GPU in one device call (docs/benchmarks.md, section 10): the packed-weight products against
# the portable path (bench/check_quant.py), workload 2 with bf16 and with int8 / int4 / fp8 weights quantized at load,
# and batch-1 decode of Qwen3-0.6B and Llama-3.2-1B in each format (gpu_benchmarks.py decode_quant).
#   bash bench/quant_on_device.sh            (QUANT_STEPS="check throughput decode" by default)
#   ROUNDS=2 QUANT_FORMATS="none int4 int8" QUANT_STEPS=throughput bash bench/quant_on_device.sh
# Workload 2 alternates the formats (QUANT_FORMATS, "none" = bf16) ROUNDS times, each run's JSON under
# round<r>/ of $OUT/throughput.tgz, one line a run in $OUT/quant_throughput.txt (a format's first run on a fresh machine
# compiles its kernels at load, and has come out slower: compare the later rounds).
set -u
steps=${QUANT_STEPS:-check throughput decode}
failed=0
for step in $steps; do
  case $step in
    check) bash bench/run_on_device.sh quant || failed=1 ;;
    throughput)
      for r in $(seq 1 "${ROUNDS:-1}"); do
        for q in ${QUANT_FORMATS:-none int8 int4 fp8}; do
          out=${OUT:-/tmp/out}/throughput/round$r
          if [ "$q" = none ]; then env OUT="$out" BENCH_WARMUP_REQUESTS=32 bash bench/run_on_device.sh throughput || failed=1
          else env OUT="$out" BENCH_WARMUP_REQUESTS=32 BENCH_QUANTIZATION=$q bash bench/run_on_device.sh throughput || failed=1; fi
          python3 - "$out" "$q" "$r" >> "${OUT:-/tmp/out}/quant_throughput.txt" <<'EOF_PY'
import json, sys
from pathlib import Path
out, q, r = sys.argv[1:]
run = json.loads(Path(out, "bench_throughput.json" if q == "none" else f"bench_throughput_{q}.json").read_text())
print(f"round {r} {q}: {run['output_tok_s']:,.0f} output tok/s ({run['seconds']:.2f} s)")
EOF_PY
        done
      done
      # (one file back from the device for all the runs' JSON and logs)
      tar czf "${OUT:-/tmp/out}/throughput.tgz" -C "${OUT:-/tmp/out}" throughput && rm -rf "${OUT:-/tmp/out}/throughput" ;;
    decode) bash bench/run_on_device.sh decode_quant || failed=1 ;;
  esac
done
exit $failed
