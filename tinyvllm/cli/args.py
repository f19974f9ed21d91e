"""Engine flags shared by every subcommand (vLLM's names): tinyvllm's own, and vLLM's others from the table in
tinyvllm/engine_args.py, through which every engine configuration goes."""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from tinyvllm.config import (
  ATTENTION_BACKENDS,
  CUDAGRAPH_MODES,
  DTYPES,
  KV_CACHE_DTYPES,
  MAX_LOGPROBS,
  PREEMPTION_MODES,
  QUANTIZATION_METHODS,
  SCHEDULING_POLICIES,
  ConfigError,
  EngineConfig,
)
from tinyvllm.engine_args import DTYPE_ALIASES, TABLE, VllmArg
from tinyvllm.engine_args import engine_config as config_from_arguments
from tinyvllm.sampling_params import SamplingParams, SamplingParamsError


class Parser(argparse.ArgumentParser):
  """argparse's parser, but a usage error is one line (the flag and what is wrong; --help has the rest): the full usage
  of a subcommand with every engine flag would bury the message."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message}\n")


# ---- argparse `type=` functions: a bad value fails at parse time, naming the flag, before anything loads
def bounded(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False,
            high_open: bool = False, allow_inf: bool = False) -> Callable[[str], Any]:
  """An int or float flag's parser, checking low <= value <= high (< where open); floats must be finite unless allow_inf."""
  what = _describe(kind, low, high, low_open, high_open)

  def parse(text: str) -> Any:
    try: value = kind(text)
    except ValueError: raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    finite = (allow_inf and value == math.inf) or math.isfinite(value)
    above = low is None or (value > low if low_open else value >= low)
    below = high is None or (value < high if high_open else value <= high)
    if not (finite and above and below): raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value
  parse.__name__ = what   # argparse names the type in some messages
  return parse


def _describe(kind: type, low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
  noun = "an integer" if kind is int else "a number"
  if low is not None and high is not None:
    return f"{noun} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
  if low is not None: return f"{noun} {'>' if low_open else '>='} {low:g}"
  if high is not None: return f"{noun} {'<' if high_open else '<='} {high:g}"
  return noun if kind is int else "a finite number"


positive_int = bounded(int, 1)
non_negative_int = bounded(int, 0)
positive_float = bounded(float, 0, low_open=True)
non_negative_float = bounded(float, 0)
fraction = bounded(float, 0, 1, low_open=True)   # (0, 1]


def power_of_two(text: str) -> int:
  value = positive_int(text)
  if value & (value - 1): raise argparse.ArgumentTypeError(f"must be a power of two, got {text!r}")
  return value


def sampling_value(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
  """A sampling flag's parser: `parse`, then SamplingParams' own check of the value, so that the command line refuses
  exactly what a request would, at parse time."""
  def check(text: str) -> Any:
    value = parse(text)
    try: SamplingParams(**{name: value})
    except SamplingParamsError as e: raise argparse.ArgumentTypeError(str(e)) from None
    return value
  check.__name__ = name
  return check


def output_file(text: str) -> str:
  """A file the command writes at its end: its folder must exist now, not after a long run."""
  folder = Path(text).expanduser().parent
  if not folder.is_dir(): raise argparse.ArgumentTypeError(f"folder {str(folder)!r} does not exist")
  return text


def add_engine_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("model and engine")
  g.add_argument("--model", help="local HF model folder, hub id, GGUF file (a split one's first), hub GGUF as REPO_ID:QUANT_TYPE, "
                                 "or (with --load-format dummy) a preset name (default: the stories260K model shipped in "
                                 "the package)")
  g.add_argument("--tokenizer", help="tokenizer folder, if not the model's")
  g.add_argument("--dtype", default="auto", choices=(*DTYPES, *DTYPE_ALIASES),
                 help="compute dtype (auto: checkpoint's on GPU, float32 on CPU; half = float16, float = float32)")
  g.add_argument("--device", help="tinygrad backend (CUDA, METAL, CPU, ...); default: detected")
  g.add_argument("--max-model-len", type=positive_int, help="context length limit (default: the model's)")
  g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"), help="dummy: random weights")
  g.add_argument("-q", "--quantization", choices=QUANTIZATION_METHODS,
                 help="weight quantization: the checkpoint's (gptq, awq, fp8, compressed-tensors, modelopt, modelopt_fp4 "
                      "(NVFP4), fbgemm_fp8, "
                      "bitsandbytes; read from its config.json or hf_quant_config.json when not given; gptq_marlin / "
                      "awq_marlin: the same checkpoints, on tinyvllm's kernels) or a float checkpoint's linears quantized "
                      "at load (int8, int4 group 128, fp8: round-to-nearest; experts_int8: only a mixture of experts' "
                      "experts, int8); gguf: a .gguf model file's own blocks (implied by the file)")
  g.add_argument("--seed", type=sampling_value("seed", non_negative_int),
                 help="random seed: makes sampling reproducible (default: a fresh one each run)")
  g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                 help="attention kernels: auto (cuda on CUDA, metal on METAL, else portable), portable (tinygrad ops), cuda, metal")
  g.add_argument("--cuda-graph-sizes", type=positive_int, nargs="*",
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
  g.add_argument("--decode-layer-max-context", type=positive_int,
                 help="the longest context bucket the decode-layer kernel takes (default: the device's tuning table)")
  g.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=True,
                 help="keep tinygrad's scheduling and codegen of every step built in its disk cache, so that a second "
                      "start skips them (default: on)")
  g.add_argument("--download-dir", help="HF cache folder for hub models (default: HF's, $HF_HUB_CACHE or $HF_HOME/hub)")
  g.add_argument("--revision", help="hub model's branch, tag or commit (default: main)")
  g.add_argument("--tokenizer-revision", help="the tokenizer's branch, tag or commit (default: --revision)")
  g.add_argument("--hf-token", nargs="?", const=True,
                 help="hub token; the flag alone: the stored one (`hf auth login`); default: $HF_TOKEN or the stored one")
  c = p.add_argument_group("KV cache and scheduler")
  c.add_argument("--kv-cache", default="paged", choices=("paged", "contiguous"), help="contiguous: the pre-allocated baseline")
  c.add_argument("--block-size", type=power_of_two, default=16, help="tokens per KV block")
  c.add_argument("--kv-cache-memory", type=positive_float, help="GiB for the KV cache")
  c.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                 help="auto: the model's dtype; fp8 (= fp8_e4m3): E4M3 codes, half the bytes of bfloat16, scale 1")
  c.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, help="fraction of GPU memory to use (CUDA)")
  c.add_argument("--num-gpu-blocks", type=positive_int, help="exact number of KV blocks (overrides the memory flags)")
  c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                 help="reuse the KV blocks of earlier prompts' shared prefixes (default: on)")
  c.add_argument("--scheduler", default="continuous", choices=("continuous", "static"), help="static: the batch baseline")
  c.add_argument("--max-num-seqs", type=positive_int, default=256, help="most sequences in one step")
  c.add_argument("--max-num-batched-tokens", type=positive_int, help="most tokens in one step (default max(2048, max-num-seqs))")
  c.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                 help="run each prompt in one step")
  c.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0, help="most prompt tokens of one sequence per step")
  c.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                 help="fcfs: first come, first served; priority: by each request's priority (lower first, ties by arrival), "
                      "a waiting request preempting running ones of lower priority")
  c.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
                 help="a preempted sequence's KV blocks: freed and recomputed later, or swapped out to host memory and back")
  c.add_argument("--swap-space", type=non_negative_float, default=4, help="GiB of host memory for swapped-out KV blocks (default 4)")
  c.add_argument("--logits-processors", nargs="+", metavar="CLASS",
                 help="custom logits processors: qualified names of tinyvllm.layers.logits_processor.LogitsProcessor "
                      "subclasses (package.module.Class); steps then run eagerly")
  c.add_argument("--structured-outputs-config", type=json_value,
                 help='structured output, vLLM\'s JSON: \'{"disable_any_whitespace": true}\' (JSON outputs without optional '
                      'whitespace, which small models can fill forever), "backend": "guidance" (llguidance, the only one)')
  c.add_argument("--speculative-config", type=json_value,
                 help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                      '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (proposals from the sequence\'s own text) or '
                      '\'{"model": DRAFT, "num_speculative_tokens": 4}\' (a smaller model with the same tokenizer)')
  r = p.add_argument_group("requests")
  r.add_argument("--max-logprobs", type=bounded(int, 0, MAX_LOGPROBS), help="the most logprobs a request may ask for (default 20)")
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


# the numeric table arguments' parse-time checks (a value in range that tinyvllm cannot honour, e.g. -tp 2, is refused by
# the table itself, naming why, before anything loads)
TABLE_TYPES: dict[str, Callable[[str], Any]] = {
  "tensor_parallel_size": positive_int, "pipeline_parallel_size": positive_int, "data_parallel_size": positive_int,
  "max_seq_len_to_capture": positive_int, "cpu_offload_gb": non_negative_float, "kv_cache_memory_bytes": positive_int,
  "num_gpu_blocks_override": positive_int, "max_num_partial_prefills": positive_int, "max_cudagraph_capture_size": positive_int,
}


def _flag_options(arg: VllmArg) -> dict[str, Any]:
  """How the command line takes a table argument; its default None leaves it out (the engine's default holds)."""
  help_text = arg.help or arg.note or arg.refusal
  if arg.kind is bool: return {"action": argparse.BooleanOptionalAction, "default": None, "help": help_text}
  kind = TABLE_TYPES.get(arg.name) or (json_value if arg.kind == "json" else arg.kind)
  return {"type": kind, "default": None, "help": help_text}


ENGINE_FLAGS = ("tokenizer", "dtype", "device", "max_model_len", "load_format", "quantization", "kv_cache", "block_size", "kv_cache_memory",
                "kv_cache_dtype",
                "gpu_memory_utilization", "num_gpu_blocks", "enable_prefix_caching", "scheduler", "max_num_seqs",
                "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold", "attention_backend",
                "cuda_graph_sizes", "async_scheduling", "enforce_eager", "decode_layer_kernel", "compile_cache",
                "decode_layer_max_context", "download_dir", "revision", "tokenizer_revision", "hf_token", "scheduling_policy",
                "preemption_mode", "swap_space")
# flags passed on only when given (None: the engine's default)
OPTIONAL_FLAGS = ("cudagraph_mode", "speculative_config", "logits_processors", "structured_outputs_config", "reasoning_parser",
                  "max_logprobs", "generation_config", "override_generation_config",
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


def tokenizer_check(args: argparse.Namespace, chat_template: bool = False) -> Callable[[Any], None]:
  """generate's and chat's check of the frontend files (LLM's check_frontend_files), before the weights load: a
  tokenizer (and, for chat, a chat template) is needed."""
  def check(files: Any) -> None:
    if files.tokenizer is None: raise ConfigError(_no_tokenizer(args))
    if chat_template and not files.tokenizer.has_chat_template:
      raise ConfigError("this model's tokenizer has no chat template (chat_template in tokenizer_config.json, or "
                        "chat_template.jinja): chat needs one; `generate` completes plain text")
  return check


def _no_tokenizer(args: argparse.Namespace) -> str:
  if args.skip_tokenizer_init: return f"`{args.command}` needs a tokenizer: leave out --skip-tokenizer-init"
  from tinyvllm.model.presets import PRESETS
  why = ("a --load-format dummy preset has none" if args.load_format == "dummy" and args.model in PRESETS
         else "no tokenizer.json, tokenizer.model or vocab.json beside the model")
  return f"this model has no tokenizer ({why}): pass --tokenizer FOLDER"


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
  """Sampling flags; one not given takes the model's generation_config.json default, else SamplingParams'."""
  g = p.add_argument_group("sampling (default: the model's generation_config.json, else vLLM's defaults)")
  g.add_argument("--max-tokens", type=sampling_value("max_tokens", positive_int),
                 help=f"default: the model's max_new_tokens, else {max_tokens}")
  g.set_defaults(default_max_tokens=max_tokens)
  g.add_argument("--temperature", type=sampling_value("temperature", bounded(float)), help="0 = greedy (default 1.0)")
  g.add_argument("--top-p", type=sampling_value("top_p", bounded(float)), help="default 1.0")
  g.add_argument("--top-k", type=sampling_value("top_k", bounded(int)), help="0 or -1 = off (default)")
  g.add_argument("--min-p", type=sampling_value("min_p", bounded(float)), help="default 0.0")
  g.add_argument("--presence-penalty", type=sampling_value("presence_penalty", bounded(float)), help="default 0.0")
  g.add_argument("--frequency-penalty", type=sampling_value("frequency_penalty", bounded(float)), help="default 0.0")
  g.add_argument("--repetition-penalty", type=sampling_value("repetition_penalty", bounded(float)), help="default 1.0")
  g.add_argument("--stop", action="append", help="stop string (repeatable)")
  g.add_argument("--ignore-eos", action="store_true", default=None)


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop", "ignore_eos")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
  """The sampling flags given (SamplingParams names)."""
  return {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}


def sampling_params_for(args: argparse.Namespace, model_defaults: dict[str, Any]):
  """The command's SamplingParams: the flags given, over the model's defaults, over the command's max_tokens."""
  return SamplingParams(**{"max_tokens": args.default_max_tokens, **model_defaults, **sampling_kwargs(args)})
