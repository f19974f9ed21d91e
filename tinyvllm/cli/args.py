"""Engine flags shared by every subcommand (vLLM's names)."""
from __future__ import annotations

import argparse
import random
import sys
from typing import Any

from tinyvllm.config import ATTENTION_BACKENDS, CUDAGRAPH_MODES, DTYPES, KV_CACHE_DTYPES, EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("model and engine")
  g.add_argument("--model", help="local HF model folder, hub id, or (with --load-format dummy) a preset name (default: the "
                                 "stories260K model shipped in the package)")
  g.add_argument("--tokenizer", help="tokenizer folder, if not the model's")
  g.add_argument("--dtype", default="auto", choices=DTYPES, help="compute dtype (auto: checkpoint's on GPU, float32 on CPU)")
  g.add_argument("--device", help="tinygrad backend (CUDA, METAL, CPU, ...); default: detected")
  g.add_argument("--max-model-len", type=int, help="context length limit (default: the model's)")
  g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"), help="dummy: random weights")
  g.add_argument("--seed", type=int, help="random seed: makes sampling reproducible (default: a fresh one each run)")
  g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                 help="attention kernels: auto (cuda on CUDA, metal on METAL, else portable), portable (tinygrad ops), cuda, metal")
  g.add_argument("--cuda-graph-sizes", type=int, nargs="*",
                 help="decode batch sizes to capture at start-up (default: powers of two up to --max-num-seqs on a GPU, "
                      "none on the CPU; the flag alone: none)")
  g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                 help="schedule each step while the previous one runs on the device (default: on for CUDA)")
  g.add_argument("--cudagraph-mode", type=str.upper, choices=CUDAGRAPH_MODES, default="FULL",
                 help="step layouts run as captured graphs: FULL, FULL_DECODE_ONLY or NONE (default: FULL; on the CPU a "
                      "layout with prompt chunks is captured when met the second time)")
  g.add_argument("--enforce-eager", action="store_true", help="run every step eagerly, nothing captured (= --cudagraph-mode NONE)")
  g.add_argument("--decode-layer-kernel", action=argparse.BooleanOptionalAction, default=True,
                 help="CUDA, Hopper: every layer of 1-4-sequence decode steps in one persistent kernel (default: on)")
  g.add_argument("--decode-layer-max-context", type=int,
                 help="the longest context bucket the decode-layer kernel takes (default: the device's tuning table)")
  g.add_argument("--download-dir", help="where hub models are downloaded (default: $TINYVLLM_CACHE/hub, ~/.cache/tinyvllm/hub)")
  c = p.add_argument_group("KV cache and scheduler")
  c.add_argument("--kv-cache", default="paged", choices=("paged", "contiguous"), help="contiguous: the pre-allocated baseline")
  c.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
  c.add_argument("--kv-cache-memory", type=float, help="GiB for the KV cache")
  c.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                 help="auto: the model's dtype; fp8 (= fp8_e4m3): E4M3 codes, half the bytes of bfloat16, scale 1")
  c.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use (CUDA)")
  c.add_argument("--num-gpu-blocks", type=int, help="exact number of KV blocks (overrides the memory flags)")
  c.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help="turn prefix caching off")
  c.add_argument("--scheduler", default="continuous", choices=("continuous", "static"), help="static: the batch baseline")
  c.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
  c.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one step (default max(2048, max-num-seqs))")
  c.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                 help="run each prompt in one step")
  c.add_argument("--long-prefill-token-threshold", type=int, default=0, help="most prompt tokens of one sequence per step")


ENGINE_FLAGS = ("tokenizer", "dtype", "device", "max_model_len", "load_format", "kv_cache", "block_size", "kv_cache_memory",
                "kv_cache_dtype",
                "gpu_memory_utilization", "num_gpu_blocks", "enable_prefix_caching", "scheduler", "max_num_seqs",
                "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold", "attention_backend",
                "cuda_graph_sizes", "async_scheduling", "cudagraph_mode", "enforce_eager", "decode_layer_kernel",
                "decode_layer_max_context", "download_dir")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
  kwargs = {k: getattr(args, k) for k in ENGINE_FLAGS}
  return {**kwargs, "seed": args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)}


def model_or_embedded(args: argparse.Namespace) -> str:
  """--model, or the folder of the model shipped in the package when none is given (said on stderr)."""
  if args.model is not None: return args.model
  from tinyvllm.model.embedded import EMBEDDED_MODEL, embedded_model_path
  print(f"[tinyvllm] no --model given: running the embedded {EMBEDDED_MODEL} (a 260K-parameter story model from llama2.c, "
        f"MIT) at {embedded_model_path()}", file=sys.stderr, flush=True)
  return str(embedded_model_path())


def engine_config(args: argparse.Namespace) -> EngineConfig:
  return EngineConfig(model=model_or_embedded(args), **engine_kwargs(args))


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
  g = p.add_argument_group("sampling")
  g.add_argument("--max-tokens", type=int, default=max_tokens)
  g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
  g.add_argument("--min-p", type=float, default=0.0)
  g.add_argument("--presence-penalty", type=float, default=0.0)
  g.add_argument("--frequency-penalty", type=float, default=0.0)
  g.add_argument("--repetition-penalty", type=float, default=1.0)
  g.add_argument("--stop", action="append", help="stop string (repeatable)")
  g.add_argument("--ignore-eos", action="store_true")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
  return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
          "min_p": args.min_p, "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
          "repetition_penalty": args.repetition_penalty, "seed": args.seed, "stop": args.stop,
          "ignore_eos": args.ignore_eos}
