"""Engine flags shared by every subcommand (vLLM's names): tinyvllm's own, and vLLM's others from the table in
tinyvllm/engine_args.py, through which every engine configuration goes."""
from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

from tinyvllm.config import (
  ATTENTION_BACKENDS,
  CUDAGRAPH_MODES,
  DTYPES,
  KV_CACHE_DTYPES,
  PREEMPTION_MODES,
  QUANTIZATION_METHODS,
  SCHEDULING_POLICIES,
  ConfigError,
  EngineConfig,
)
from tinyvllm.engine_args import DTYPE_ALIASES, TABLE, VllmArg
from tinyvllm.engine_args import engine_config as config_from_arguments


def add_engine_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("model and engine")
  g.add_argument("--model", help="local HF model folder, hub id, or (with --load-format dummy) a preset name (default: the "
                                 "stories260K model shipped in the package)")
  g.add_argument("--tokenizer", help="tokenizer folder, if not the model's")
  g.add_argument("--dtype", default="auto", choices=(*DTYPES, *DTYPE_ALIASES),
                 help="compute dtype (auto: checkpoint's on GPU, float32 on CPU; half = float16, float = float32)")
  g.add_argument("--device", help="tinygrad backend (CUDA, METAL, CPU, ...); default: detected")
  g.add_argument("--max-model-len", type=int, help="context length limit (default: the model's)")
  g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"), help="dummy: random weights")
  g.add_argument("-q", "--quantization", choices=QUANTIZATION_METHODS,
                 help="weight quantization: the checkpoint's (gptq, awq, fp8; read from its config.json when not given) or "
                      "a float checkpoint's linears quantized at load (int8, int4 group 128, fp8: round-to-nearest); gguf: a .gguf "
                      "model file's own blocks (implied by the file)")
  g.add_argument("--seed", type=int, help="random seed: makes sampling reproducible (default: a fresh one each run)")
  g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                 help="attention kernels: auto (cuda on CUDA, metal on METAL, else portable), portable (tinygrad ops), cuda, metal")
  g.add_argument("--cuda-graph-sizes", type=int, nargs="*",
                 help="step sizes captured at start-up: decode steps of that many sequences and, on the hand-written "
                      "kernels, prompt steps of that many tokens (default: powers of two up to the larger of --max-num-seqs "
                      "and --max-num-batched-tokens on a GPU, none on the CPU; the flag alone: none)")
  g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                 help="schedule each step while the previous one runs on the device (default: on for CUDA)")
  g.add_argument("--cudagraph-mode", type=str.upper, choices=CUDAGRAPH_MODES,
                 help="step layouts run as captured graphs: FULL, FULL_DECODE_ONLY or NONE (default: FULL; on the CPU a "
                      "layout with prompt chunks is captured when met the second time)")
  g.add_argument("--enforce-eager", action="store_true", help="run every step eagerly, nothing captured (= --cudagraph-mode NONE)")
  g.add_argument("--decode-layer-kernel", action=argparse.BooleanOptionalAction, default=True,
                 help="CUDA, Hopper: every layer of 1-4-sequence decode steps in one persistent kernel (default: on)")
  g.add_argument("--decode-layer-max-context", type=int,
                 help="the longest context bucket the decode-layer kernel takes (default: the device's tuning table)")
  g.add_argument("--download-dir", help="HF cache folder for hub models (default: HF's, $HF_HUB_CACHE or $HF_HOME/hub)")
  g.add_argument("--revision", help="hub model's branch, tag or commit (default: main)")
  g.add_argument("--tokenizer-revision", help="the tokenizer's branch, tag or commit (default: --revision)")
  g.add_argument("--hf-token", nargs="?", const=True,
                 help="hub token; the flag alone: the stored one (`hf auth login`); default: $HF_TOKEN or the stored one")
  c = p.add_argument_group("KV cache and scheduler")
  c.add_argument("--kv-cache", default="paged", choices=("paged", "contiguous"), help="contiguous: the pre-allocated baseline")
  c.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
  c.add_argument("--kv-cache-memory", type=float, help="GiB for the KV cache")
  c.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                 help="auto: the model's dtype; fp8 (= fp8_e4m3): E4M3 codes, half the bytes of bfloat16, scale 1")
  c.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use (CUDA)")
  c.add_argument("--num-gpu-blocks", type=int, help="exact number of KV blocks (overrides the memory flags)")
  c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                 help="reuse the KV blocks of earlier prompts' shared prefixes (default: on)")
  c.add_argument("--scheduler", default="continuous", choices=("continuous", "static"), help="static: the batch baseline")
  c.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
  c.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one step (default max(2048, max-num-seqs))")
  c.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                 help="run each prompt in one step")
  c.add_argument("--long-prefill-token-threshold", type=int, default=0, help="most prompt tokens of one sequence per step")
  c.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                 help="fcfs: first come, first served; priority: by each request's priority (lower first, ties by arrival), "
                      "a waiting request preempting running ones of lower priority")
  c.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
                 help="a preempted sequence's KV blocks: freed and recomputed later, or swapped out to host memory and back")
  c.add_argument("--swap-space", type=float, default=4, help="GiB of host memory for swapped-out KV blocks (default 4)")
  c.add_argument("--speculative-config", type=json_value,
                 help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                      '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (proposals from the sequence\'s own text) or '
                      '\'{"model": DRAFT, "num_speculative_tokens": 4}\' (a smaller model with the same tokenizer)')
  r = p.add_argument_group("requests")
  r.add_argument("--max-logprobs", type=int, help="the most logprobs a request may ask for (default 20)")
  r.add_argument("--generation-config", help="request sampling defaults: auto (the model's generation_config.json, the "
                                             "default), vllm (none), or a folder holding a generation_config.json")
  r.add_argument("--override-generation-config", type=json_value,
                 help='JSON of generation_config fields on top, e.g. \'{"temperature": 0.5}\'')
  r.add_argument("--skip-tokenizer-init", action=argparse.BooleanOptionalAction, default=None,
                 help="no tokenizer: prompts are token ids, outputs carry no text")
  r.add_argument("--disable-log-stats", action=argparse.BooleanOptionalAction, default=None,
                 help="no periodic throughput / KV cache line in the log")
  v = p.add_argument_group("vLLM's other engine arguments", "accepted where tinyvllm does what they ask, refused naming the "
                           "argument where it cannot (tinyvllm/engine_args.py)")
  for arg in TABLE:
    if arg.kind is not None: v.add_argument(f"--{arg.name.replace('_', '-')}", *arg.flag, **_flag_options(arg))


def json_value(text: str) -> Any:
  try: return json.loads(text)
  except json.JSONDecodeError as e: raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def _flag_options(arg: VllmArg) -> dict[str, Any]:
  """How the command line takes a table argument; its default None leaves it out (the engine's default holds)."""
  help_text = arg.note or arg.refusal
  if arg.kind is bool: return {"action": argparse.BooleanOptionalAction, "default": None, "help": help_text}
  return {"type": json_value if arg.kind == "json" else arg.kind, "default": None, "help": help_text}


ENGINE_FLAGS = ("tokenizer", "dtype", "device", "max_model_len", "load_format", "quantization", "kv_cache", "block_size", "kv_cache_memory",
                "kv_cache_dtype",
                "gpu_memory_utilization", "num_gpu_blocks", "enable_prefix_caching", "scheduler", "max_num_seqs",
                "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold", "attention_backend",
                "cuda_graph_sizes", "async_scheduling", "enforce_eager", "decode_layer_kernel",
                "decode_layer_max_context", "download_dir", "revision", "tokenizer_revision", "hf_token", "scheduling_policy",
                "preemption_mode", "swap_space")
# flags passed on only when given (None: the engine's default)
OPTIONAL_FLAGS = ("cudagraph_mode", "speculative_config", "max_logprobs", "generation_config", "override_generation_config",
                  "skip_tokenizer_init",
                  "disable_log_stats",
                  *(arg.name for arg in TABLE if arg.kind is not None))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
  """The engine arguments the command line gives, by vLLM's names (LLM(...) takes them)."""
  kwargs = {k: getattr(args, k) for k in ENGINE_FLAGS}
  kwargs.update({k: getattr(args, k) for k in OPTIONAL_FLAGS if getattr(args, k, None) is not None})
  return {**kwargs, "seed": args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)}


def model_of(args: argparse.Namespace) -> str:
  """The model: `serve MODEL` (vLLM's form) or --model, not both; neither: the stories260K model shipped in the package
  (said on stderr)."""
  positional, flag = getattr(args, "model_tag", None), args.model
  if positional and flag: raise ConfigError(f"the model is given twice (MODEL {positional!r} and --model {flag!r}); give one")
  if positional or flag: return positional or flag
  from tinyvllm.model.embedded import EMBEDDED_MODEL, embedded_model_path
  _note(f"no model given: running the embedded {EMBEDDED_MODEL} (a 260K-parameter story model from llama2.c, MIT) at "
        f"{embedded_model_path()}")
  return str(embedded_model_path())


def _note(message: str) -> None: print(f"[tinyvllm] {message}", file=sys.stderr, flush=True)


def engine_config(args: argparse.Namespace) -> EngineConfig:
  return config_from_arguments(model_of(args), engine_kwargs(args), _note)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
  """Sampling flags; one not given takes the model's generation_config.json default, else SamplingParams'."""
  g = p.add_argument_group("sampling (default: the model's generation_config.json, else vLLM's defaults)")
  g.add_argument("--max-tokens", type=int, help=f"default: the model's max_new_tokens, else {max_tokens}")
  g.set_defaults(default_max_tokens=max_tokens)
  g.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
  g.add_argument("--top-p", type=float, help="default 1.0")
  g.add_argument("--top-k", type=int, help="0 or -1 = off (default)")
  g.add_argument("--min-p", type=float, help="default 0.0")
  g.add_argument("--presence-penalty", type=float, help="default 0.0")
  g.add_argument("--frequency-penalty", type=float, help="default 0.0")
  g.add_argument("--repetition-penalty", type=float, help="default 1.0")
  g.add_argument("--stop", action="append", help="stop string (repeatable)")
  g.add_argument("--ignore-eos", action="store_true", default=None)


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop", "ignore_eos")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
  """The sampling flags given (SamplingParams names)."""
  return {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}


def sampling_params_for(args: argparse.Namespace, model_defaults: dict[str, Any]):
  """The command's SamplingParams: the flags given, over the model's defaults, over the command's max_tokens."""
  from tinyvllm.sampling_params import SamplingParams
  return SamplingParams(**{"max_tokens": args.default_max_tokens, **model_defaults, **sampling_kwargs(args)})
