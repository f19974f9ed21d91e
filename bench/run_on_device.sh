#!/usr/bin/env bash
# One device call (see docs/benchmarks.md): install the carried wheels, then run the named steps in order, each one's
# output appended to $OUT/log.txt and its JSON written under $OUT. Exits 1 if any step failed.
#   bash bench/run_on_device.sh check throughput decode profile256 ...
# Steps: check (the GPU check: bench/check_kernels.py, then bench/check_decode_layer.py), layer
# (bench/check_decode_layer.py alone), quant (bench/check_kernels.py's packed-weight products alone), logits (its wide
# products alone), check_moe
# (its mixture-of-experts kernels alone), check_moe_packed (bench/check_moe_packed.py: packed experts alone), wheel (the tinyvllm wheel carried in .dist/, installed alone and run
# from /tmp), bound (bench/layer_bound.py), phases (bench/layer_phases.py: the layer kernel's time by phase), profile1 / profile256 (bench/gpu_profile.py), gemm (bench/gemm_bench.py),
# timeline (bench/step_timeline.py; timeline_moe: the same for the Qwen3-30B-A3B shape, MOE_KV_GIB of cache, on nvidia-h200),
# graph_moe (bench/graph_kernels.py: workload 2 of the Qwen3-30B-A3B shape timed, then each kernel's time inside decode
# steps of 256 down to 1 sequences), graph_b1_MODEL (the same for a batch-1 decode step of MODEL, e.g. graph_b1_llama-3.2-1b;
# BENCH_QUANTIZATION=int4 quantizes it), moe_decode_bound (bench/moe_decode_bound.py), serve_profile (bench/serve_profile.py:
# workload 3 against the server with timers on each stage; SERVE_ARGS adds server flags), sweep (bench/serve_sweep.py:
# 1-256 concurrent clients; plotted here with --replot), explore (bench/attention_bench.py; gqa: its decode kernel against the tensor-core one by GQA group, GQA_BATCHES), sampler (bench/sampler_bench.py), spec (bench/spec_bench.py), gguf
# (bench/gguf_bench.py: GGUF mixes' packed linears against the portable path and against bf16; GGUF_MIXES picks them), moe (bench/moe_bench.py: the Qwen3-30B-A3B shape;
# MOE_PARTS picks its parts; run it on nvidia-h200), structured (bench/structured_bench.py: batch-64 decode with every
# row under a JSON schema against free decoding; needs the Qwen3 tokenizer in .data/qwen3 and the llguidance wheel in
# .whl/), host1 / host256 (bench/step_host.py: a
# decode step's host time by stage), and any part
# of bench/gpu_benchmarks.py (with the suffix _fp8: the same part with --kv-cache-dtype fp8, e.g. throughput_fp8);
# check_tp2 (bench/check_kernels.py with its engine checks at TP=2), tp2 / tp4 (bench/tp_check.py: tensor parallelism's greedy tokens against stories260K's reference and TP=1),
# decode_8b_tp1 / _tp2 / _tp4 (batch-1 decode of the Qwen3-8B shape over that many GPUs), tpN_no_all_reduce / tpN_share
# (bench/tp_overhead.py: the same with the all-reduces skipped; one GPU running one device's share), multi_device_graph
# (bench/multi_device_graph.py: kernel chains in one- and multi-device CUDA graphs, MDG_DEVICES GPUs), profile8b_tp1 / _tp2 / _tp4 (bench/gpu_profile.py
# on it; under TP its step breakdown and host profile, no eager per-kernel profile), serve_dp2 (workload 3 against two data-parallel replicas), serve_2clients / serve_dp2_2clients (the same with
# two client processes), serve_asc2 / serve_asc2_2clients (two API server processes, one or two clients),
# serve_dp2_asc4_4clients (two replicas behind four API servers, four clients), serve_asc4_2clients /
# serve_dp2_asc8_4clients (one replica behind four API servers with two clients; two behind eight with four),
# serve_asc4_16k (the serving target's flags), startup_profile (the startup part under cProfile: where a start's time goes).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD DEV=CUDA OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

# both GPU checks; fails if either does
check_all() {
  python3 bench/check_kernels.py --model .data/stories260K-hf --no-e2e
  local kernels=$?
  python3 bench/check_decode_layer.py
  local layer=$?
  echo "check: bench/check_kernels.py exit $kernels, bench/check_decode_layer.py exit $layer"
  [ "$kernels" -eq 0 ] && [ "$layer" -eq 0 ]
}

# the package as users install it: the wheel alone in /tmp/wheelsite (dependencies from /tmp/site), run from /tmp with
# no checkout on the path; prints the file tinyvllm was imported from and the engine's backend lines
wheel_check() {
  local repo=$PWD wheels=(.dist/tinyvllm-*.whl)
  [ -f "${wheels[0]}" ] || { echo "wheel: no .dist/tinyvllm-*.whl carried"; return 1; }
  rm -rf /tmp/wheelsite
  python3 -m pip install -q --no-deps --no-index --target /tmp/wheelsite "${wheels[@]}" || return 1
  (cd /tmp && PYTHONPATH=/tmp/site:/tmp/wheelsite python3 -c '
import sys, tinyvllm
print(f"tinyvllm imported from {tinyvllm.__file__}", file=sys.stderr, flush=True)
from tinyvllm.cli import main
sys.exit(main())' generate --model "$repo/.data/stories260K-hf" --prompt "Once upon a time" --max-tokens 64 --temperature 0 \
    >"$OUT/wheel_generate.txt" 2>"$OUT/wheel_stderr.txt")
  local status=$?
  grep -E "tinyvllm imported from|backend" "$OUT/wheel_stderr.txt"
  echo "generated: $(cat "$OUT/wheel_generate.txt")"
  [ "$status" -eq 0 ] || { echo "wheel: generate exited $status"; tail -n 30 "$OUT/wheel_stderr.txt"; return 1; }
  grep -q "tinyvllm imported from /tmp/wheelsite/" "$OUT/wheel_stderr.txt" || { echo "wheel: not the installed copy"; return 1; }
  echo "wheel: ok"
}

failed=0
for step in "$@"; do
  echo "=== $step $(date -u +%FT%TZ)" | tee -a "$OUT/log.txt"
  case $step in
    check) cmd=(check_all) ;;
    layer) cmd=(python3 bench/check_decode_layer.py) ;;
    quant) cmd=(python3 bench/check_kernels.py --skip compile,correctness,engine,engine-fp8,sample,logits,moe,bench,prefill-bench,e2e) ;;
    logits) cmd=(python3 bench/check_kernels.py --skip compile,correctness,engine,engine-fp8,sample,quant,moe,bench,prefill-bench,e2e) ;;
    check_moe) cmd=(python3 bench/check_kernels.py --skip compile,correctness,engine,engine-fp8,sample,quant,logits,bench,prefill-bench,e2e) ;;
    check_moe_packed) cmd=(python3 bench/check_moe_packed.py) ;;
    wheel) cmd=(wheel_check) ;;
    bound) cmd=(python3 bench/layer_bound.py ${BOUND_CASES:+--cases "$BOUND_CASES"}) ;;
    phases) cmd=(python3 bench/layer_phases.py) ;;
    profile1) cmd=(python3 bench/gpu_profile.py --batch 1 --tag b1) ;;
    profile256) cmd=(python3 bench/gpu_profile.py --batch 256 --tag b256) ;;
    gemm) cmd=(python3 bench/gemm_bench.py --rows "${GEMM_ROWS:-1,4,16,32,64,128,256,1024,4096}") ;;
    timeline) cmd=(python3 bench/step_timeline.py) ;;
    timeline_moe*) cmd=(python3 bench/step_timeline.py --model qwen3-30b-a3b --kv-cache-memory "${MOE_KV_GIB:-40}"
                        --kv-cache-dtype "$([ "$step" = timeline_moe_fp8 ] && echo fp8 || echo auto)") ;;
    graph_moe) cmd=(python3 bench/graph_kernels.py --model qwen3-30b-a3b --kv-cache-memory "${MOE_KV_GIB:-40}" --timed) ;;
    graph_b1_*) cmd=(python3 bench/graph_kernels.py --workload decode --kv-cache-memory 4 --model "${step#graph_b1_}"
                     ${BENCH_QUANTIZATION:+--quantization "$BENCH_QUANTIZATION"}) ;;
    moe_decode_bound) cmd=(python3 bench/moe_decode_bound.py) ;;
    explore) cmd=(python3 bench/attention_bench.py) ;;
    gqa) cmd=(python3 bench/attention_bench.py --gqa --batches "${GQA_BATCHES:-64,256}") ;;
    sampler) cmd=(python3 bench/sampler_bench.py) ;;
    spec) cmd=(python3 bench/spec_bench.py --parts "${SPEC_PARTS:-verify,ngram,draft}") ;;
    gguf) cmd=(python3 bench/gguf_bench.py --mixes "${GGUF_MIXES:-q4_k_m,q4_k_m_by_layer,q5_k_m,q8_0}" --parts "${GGUF_PARTS:-check,decode}") ;;
    moe) cmd=(python3 bench/moe_bench.py ${MOE_PARTS:-decode throughput hf}) ;;
    structured) cmd=(python3 bench/structured_bench.py --tokenizer .data/qwen3 --repeat 3 --check-sync) ;;
    host1) cmd=(python3 bench/step_host.py --batch 1 --out "$OUT/step_host_b1.json") ;;
    host256) cmd=(python3 bench/step_host.py --batch 256 --kv-cache-dtype fp8 --out "$OUT/step_host_b256_fp8.json") ;;
    serve_profile) cmd=(python3 bench/serve_profile.py --out "$OUT/serve_profile.json" -- --model qwen3-0.6b --load-format dummy
                        --dtype bfloat16 --kv-cache-memory 40 --max-num-seqs 256 --max-model-len 4096 ${SERVE_ARGS:-}) ;;
    sweep) cmd=(python3 bench/serve_sweep.py --out "$OUT/serve_sweep.json" --prompts-per-client 2 -- --model qwen3-0.6b
                --load-format dummy --dtype bfloat16 --kv-cache-memory 40 --max-num-seqs 256 --max-model-len 4096 ${SERVE_ARGS:-}) ;;
    check_tp2) cmd=(python3 bench/check_kernels.py --model .data/stories260K-hf --tensor-parallel-size 2
                    --skip bench,prefill-bench) ;;
    profile8b_tp*) cmd=(python3 bench/gpu_profile.py --model qwen3-8b --batch 1 --tensor-parallel-size "${step#profile8b_tp}"
                        --tag "8b_tp${step#profile8b_tp}") ;;
    tp2|tp4) cmd=(python3 bench/tp_check.py --tp "${step#tp}" --stories .data/stories260K-hf) ;;
    multi_device_graph) cmd=(python3 bench/multi_device_graph.py --devices "${MDG_DEVICES:-4}") ;;
    tp[0-9]_*) cmd=(python3 bench/tp_overhead.py --tp "${step:2:1}" --part "${step#tp?_}") ;;
    decode_8b_tp*) cmd=(python3 main.py bench decode --model qwen3-8b --load-format dummy --dtype bfloat16 --batch-size 1
                        --prompt-len 128 --max-tokens 256 --max-model-len 4096 -tp "${step#decode_8b_tp}") ;;
    startup_profile) cmd=(python3 bench/profile_part.py startup --out "$OUT/startup.prof") ;;
    *_fp8) cmd=(env BENCH_KV_CACHE_DTYPE=fp8 python3 bench/gpu_benchmarks.py "${step%_fp8}") ;;
    *) cmd=(python3 bench/gpu_benchmarks.py "$step") ;;
  esac
  "${cmd[@]}" 2>&1 | tee -a "$OUT/log.txt" | tail -n 40
  status=${PIPESTATUS[0]}
  if [ "$status" -ne 0 ]; then
    echo "=== $step FAILED (exit $status)" | tee -a "$OUT/log.txt"
    failed=1
  fi
done
exit $failed
