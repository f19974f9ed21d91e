#!/usr/bin/env bash
# Weight quantization on the GPU in one device call (docs/benchmarks.md, section 10): the packed-weight products against
# the portable path (bench/check_quant.py), workload 2 with bf16 and with int8 / int4 / fp8 weights quantized at load,
# and batch-1 decode of Qwen3-0.6B and Llama-3.2-1B in each format (gpu_benchmarks.py decode_quant).
#   bash bench/quant_on_device.sh            (QUANT_STEPS="check throughput decode" by default)
#   ROUNDS=2 QUANT_FORMATS="none int4 int8" QUANT_STEPS=throughput bash bench/quant_on_device.sh
# Workload 2 alternates the formats (QUANT_FORMATS, "none" = bf16) ROUNDS times (bench/throughput_ab.sh: one line a run
# in $OUT/throughput_ab.txt, each run's JSON in $OUT/throughput_ab.tgz).
set -u
steps=${QUANT_STEPS:-check throughput decode}
failed=0
for step in $steps; do
  case $step in
    check) bash bench/run_on_device.sh quant || failed=1 ;;
    throughput) QUANT_FORMATS=${QUANT_FORMATS:-none int8 int4 fp8} bash bench/throughput_ab.sh || failed=1 ;;
    decode) bash bench/run_on_device.sh decode_quant || failed=1 ;;
  esac
done
exit $failed
