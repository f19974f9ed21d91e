"""vLLM's engine arguments (`LLM(...)` keywords, `serve` flags) and what tinyvllm does with each: one table.

Every EngineConfig field is an argument under its own name. The table adds vLLM's other arguments: the field each one
sets (under another name, or with its value converted), or, for one that describes what tinyvllm does anyway, the
values accepted and why nothing needs setting; any other value is refused with the reason. A name that is neither a
field nor in the table is refused with the closest known name. `LLM(...)` and the command line both go through
`engine_config()`, so a vLLM script and a vLLM command line meet the same rules.
"""
from __future__ import annotations

import difflib
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from tinyvllm.config import CUDAGRAPH_MODES, ConfigError, EngineConfig

Fields = dict[str, Any]


@dataclass(frozen=True)
class VllmArg:
  """One vLLM argument: the values tinyvllm honours and the EngineConfig fields a value sets."""
  name: str
  accepts: Callable[[Any], bool]
  refusal: str                                  # why a value outside `accepts` cannot be honoured
  sets: Callable[[Any], Fields] = lambda value: {}
  note: str = ""                                # for an accepted value that sets nothing: why that is vLLM's meaning here
  default: Any = None                           # vLLM's default (a value equal to it is never noted)
  flag: tuple[str, ...] = ()                    # command-line names beyond --name-with-dashes (e.g. -tp)
  kind: Any = None                              # the command-line value's type: bool, int, float, str, "json"; None: no flag
  help: str = ""                                # the flag's help, where neither the note nor the refusal says what it does


def _field(name: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], Fields]:
  return lambda value: {name: convert(value)}


def _is(*allowed: Any) -> Callable[[Any], bool]:
  return lambda value: value in allowed


def _empty(value: Any) -> bool: return not value
def _is_bool(value: Any) -> bool: return isinstance(value, bool)


def _positive_int(value: Any) -> bool: return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _powers_of_two_up_to(limit: int) -> list[int]:
  return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _compilation(value: Any) -> Fields:
  """vLLM's compilation_config (or its level alone, as -O3 gives it): the parts that are CUDA-graph capture."""
  config = {"level": value} if isinstance(value, int) and not isinstance(value, bool) else dict(value or {})
  out: Fields = {}
  level = config.pop("mode", config.pop("level", None))
  if level is not None:
    if level not in (0, 1, 2, 3): raise ConfigError(f"compilation_config level/mode must be 0-3, got {level!r}")
    if level < 3: out["cudagraph_mode"] = "NONE"   # vLLM captures no CUDA graphs below its own compiler's level 3
  for key, v in config.items():
    if key == "cudagraph_capture_sizes": out["cuda_graph_sizes"] = list(v)
    elif key == "max_cudagraph_capture_size": out["cuda_graph_sizes"] = _powers_of_two_up_to(int(v))
    elif key == "cudagraph_mode" and str(v).upper() in CUDAGRAPH_MODES: out["cudagraph_mode"] = str(v).upper()
    else:
      raise ConfigError(f"compilation_config[{key!r}]={v!r} is not supported: tinyvllm maps level/mode, cudagraph_mode "
                        f"({', '.join(CUDAGRAPH_MODES)}), cudagraph_capture_sizes and max_cudagraph_capture_size")
  return out


def _compilation_ok(value: Any) -> bool: return value is None or isinstance(value, (int, dict))


def _kv_bytes_to_gib(value: int) -> float: return value / 2**30


DTYPE_ALIASES = {"half": "float16", "float": "float32"}

TABLE: tuple[VllmArg, ...] = (
  # parallelism: tensor and data parallel (pipeline parallelism is not built)
  VllmArg("tensor_parallel_size", _positive_int, "must be an integer >= 1", _field("tensor_parallel_size"), default=1,
          flag=("-tp",), kind=int, help="split the model over this many GPUs of this host (default 1)"),
  VllmArg("pipeline_parallel_size", _is(1), "pipeline parallelism is not built (tensor and data parallelism are)",
          default=1, flag=("-pp",), kind=int),
  VllmArg("data_parallel_size", _positive_int, "must be an integer >= 1", _field("data_parallel_size"), default=1,
          flag=("-dp",), kind=int, help="serve: this many engine replicas behind one endpoint (default 1)"),
  VllmArg("distributed_executor_backend", _is(None, "uni", "mp", "ray"), "must be uni, mp or ray",
          _field("distributed_executor_backend"), kind=str,
          help="where data-parallel replicas run: mp (processes on this host, the default) or ray (Ray actors)"),
  VllmArg("enable_expert_parallel", _is(False), "expert parallelism is not built",
          default=False, kind=bool),
  VllmArg("disable_custom_all_reduce", _is_bool, "must be true or false", _field("disable_custom_all_reduce"), default=False,
          kind=bool, help="tensor parallelism: all-reduce with copies between the GPUs and adds instead of the kernel that "
          "reads the other GPUs' memory"),
  # the model
  VllmArg("trust_remote_code", _is_bool, "must be true or false", default=False, kind=bool,
          note="tinyvllm never runs code from a model repository: its own Llama/Qwen code loads the supported architectures"),
  VllmArg("task", _is(None, "auto", "generate"), "tinyvllm only generates text (task generate)", kind=str),
  VllmArg("runner", _is("auto", "generate"), "tinyvllm only generates text (runner generate)", default="auto", kind=str),
  VllmArg("convert", _is("auto", "none"), "tinyvllm converts no model to pooling", default="auto", kind=str),
  VllmArg("tokenizer_mode", _is("auto", "hf", "slow"), "tinyvllm has one tokenizer (HF's ids), no mistral or custom mode",
          default="auto", kind=str, note="tinyvllm's one tokenizer gives the ids of HF's, fast or slow"),
  VllmArg("hf_overrides", _empty, "overriding config.json fields is not supported yet", kind="json"),
  VllmArg("logprobs_mode", _is("raw_logprobs"), "tinyvllm returns logprobs of the raw logits (raw_logprobs) only",
          default="raw_logprobs", kind=str),
  VllmArg("model_impl", _is("auto", "vllm"), "tinyvllm runs its own model code only", default="auto", kind=str),
  VllmArg("enable_sleep_mode", _is(False), "sleep mode is not supported", default=False, kind=bool),
  VllmArg("enable_prompt_embeds", _is(False), "prompt embeddings are not supported; prompts are text or token ids",
          default=False, kind=bool),
  VllmArg("served_model_name", lambda v: v is None or isinstance(v, (str, list)), "must be a name or a list of names",
          note="only the server answers to a model name (`serve --served-model-name`)"),
  VllmArg("max_seq_len_to_capture", _positive_int, "must be an integer >= 1", default=8192, kind=int,
          note="captured steps cover every context length"),
  VllmArg("disable_sliding_window", _is_bool, "must be true or false", default=False, kind=bool,
          note="no supported model uses sliding-window attention"),
  VllmArg("disable_cascade_attn", _is_bool, "must be true or false", default=False, kind=bool,
          note="tinyvllm has no cascade attention"),
  VllmArg("allowed_local_media_path", _empty, "tinyvllm has no multimodal models", default="", kind=str),
  VllmArg("limit_mm_per_prompt", _empty, "tinyvllm has no multimodal models", kind="json"),
  VllmArg("mm_processor_kwargs", _empty, "tinyvllm has no multimodal models", kind="json"),
  VllmArg("dtype", lambda v: isinstance(v, str), "must be a dtype name", _field("dtype", lambda v: DTYPE_ALIASES.get(v, v))),
  VllmArg("seed", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "must be an integer or None",
          _field("seed", lambda v: random.SystemRandom().getrandbits(32) if v is None else v)),   # None: a fresh seed
  # the KV cache
  VllmArg("cpu_offload_gb", _is(0), "offloading weights to the CPU is not supported", default=0, kind=float),
  VllmArg("kv_cache_memory_bytes", _positive_int, "must be a number of bytes >= 1", _field("kv_cache_memory", _kv_bytes_to_gib),
          kind=int),
  VllmArg("num_gpu_blocks_override", _positive_int, "must be an integer >= 1", _field("num_gpu_blocks"), kind=int),
  VllmArg("calculate_kv_scales", _is(False), "the FP8 KV cache stores E4M3 codes with scale 1", default=False, kind=bool),
  # the scheduler
  VllmArg("max_num_partial_prefills", _is(1), "one prompt at a time is chunked", default=1, kind=int),
  VllmArg("enable_lora", _is(False, None), "LoRA adapters are not supported yet", default=False, kind=bool),
  # compilation: the CUDA-graph parts map onto tinyvllm's captured steps
  VllmArg("compilation_config", _compilation_ok, "must be a level (0-3) or a dict", _compilation, flag=("-O",), kind="json"),
  VllmArg("cudagraph_capture_sizes", lambda v: isinstance(v, list), "must be a list of batch sizes", _field("cuda_graph_sizes")),
  VllmArg("max_cudagraph_capture_size", _positive_int, "must be an integer >= 1",
          _field("cuda_graph_sizes", _powers_of_two_up_to), kind=int),
  # observability
  VllmArg("otlp_traces_endpoint", _empty, "OpenTelemetry tracing is not supported", kind=str),
  VllmArg("use_tqdm_on_load", _is_bool, "must be true or false", default=True, kind=bool,
          note="loading shows no per-file progress bar (downloads show one)"),
)
BY_NAME = {arg.name: arg for arg in TABLE}


def field_names() -> set[str]: return {f.name for f in fields(EngineConfig)}


def known_names() -> set[str]: return field_names() | set(BY_NAME)


def unknown_argument(name: str) -> ConfigError:
  close = difflib.get_close_matches(name, sorted(known_names()), n=1)
  hint = f"; did you mean {close[0]!r}?" if close else ""
  return ConfigError(f"unknown engine argument {name!r}: neither vLLM's nor tinyvllm's{hint}")


def translate(arguments: dict[str, Any]) -> tuple[Fields, list[str]]:
  """vLLM-named arguments -> (EngineConfig fields, notes on accepted values that need no setting). Raises ConfigError
  naming the argument for a value tinyvllm cannot honour, an unknown name, or two arguments that set one field."""
  out: Fields = {}
  setters: dict[str, str] = {}
  notes: list[str] = []
  own = field_names()
  for name, value in arguments.items():
    arg = BY_NAME.get(name)
    if arg is None and name not in own: raise unknown_argument(name)
    if arg is None: changes = {name: value}
    else:
      if not arg.accepts(value): raise ConfigError(f"{name}={value!r}: {arg.refusal}")
      changes = arg.sets(value)
      if arg.note and value != arg.default: notes.append(f"{name}={value!r} accepted: {arg.note}")
    for field_name, field_value in changes.items():
      if field_value is None:   # None leaves the field to its default or to another argument that sets it
        out.setdefault(field_name, None)
        continue
      if field_name in setters and setters[field_name] != name:
        raise ConfigError(f"{setters[field_name]} and {name} both set {field_name}; give one of them")
      setters[field_name] = name
      out[field_name] = field_value
  return out, notes


def engine_config(model: str, arguments: dict[str, Any], log: Callable[[str], None] | None = None) -> EngineConfig:
  """The EngineConfig for `model` and vLLM-named arguments (notes on accepted no-op values go to `log`)."""
  config_fields, notes = translate(arguments)
  if "model" in config_fields: raise ConfigError("model is given twice (positionally and as model=)")
  for note in notes:
    if log is not None: log(note)
  return EngineConfig(model=model, **config_fields)
