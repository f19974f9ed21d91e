#!/usr/bin/env bash
# One device call (see docs/benchmarks.md): install the carried wheels, then run the named steps in order, each one's
# output appended to $OUT/log.txt and its JSON written under $OUT.
#   bash bench/run_on_device.sh check throughput decode profile256 ...
# Steps: check (bench/check_kernels.py), layer (bench/check_decode_layer.py), capture (bench/capture_profile.py), profile1 / profile256
# (bench/gpu_profile.py), gemm (bench/gemm_bench.py), timeline (bench/step_timeline.py), explore
# (bench/attention_bench.py), and any part of
# bench/gpu_benchmarks.py (with the suffix _fp8: the same part with --kv-cache-dtype fp8, e.g. throughput_fp8).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD DEV=CUDA OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for step in "$@"; do
  echo "=== $step $(date -u +%FT%TZ)" | tee -a "$OUT/log.txt"
  case $step in
    check) cmd=(python3 bench/check_kernels.py --model .data/stories260K-hf --no-e2e) ;;
    layer) cmd=(python3 bench/check_decode_layer.py) ;;
    layer_bench) cmd=(python3 bench/decode_layer_bench.py) ;;
    anatomy) cmd=(python3 bench/batch1_anatomy.py) ;;
    bound) cmd=(python3 bench/layer_bound.py) ;;
    capture) cmd=(python3 bench/capture_profile.py) ;;
    profile1) cmd=(python3 bench/gpu_profile.py --batch 1 --tag b1) ;;
    profile256) cmd=(python3 bench/gpu_profile.py --batch 256 --tag b256) ;;
    gemm) cmd=(python3 bench/gemm_bench.py --rows "${GEMM_ROWS:-1,4,16,32,64,128,256,1024,4096}") ;;
    timeline) cmd=(python3 bench/step_timeline.py) ;;
    explore) cmd=(python3 bench/attention_bench.py) ;;
    sampler) cmd=(python3 bench/sampler_bench.py) ;;
    *_fp8) cmd=(env BENCH_KV_CACHE_DTYPE=fp8 python3 bench/gpu_benchmarks.py "${step%_fp8}") ;;
    *) cmd=(python3 bench/gpu_benchmarks.py "$step") ;;
  esac
  "${cmd[@]}" 2>&1 | tee -a "$OUT/log.txt" | tail -n 40
done
