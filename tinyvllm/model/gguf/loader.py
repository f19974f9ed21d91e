"""Building the model from a GGUF file: its metadata's config, its tensors through GGUFSource, every tensor used."""
from __future__ import annotations

from tinygrad.dtype import DType

from tinyvllm.backend.interface import ComputeBackend
from tinyvllm.config import ConfigError, ModelConfig
from tinyvllm.model.gguf import blocks
from tinyvllm.model.gguf.reader import GGUFFile
from tinyvllm.model.gguf.source import GGUFSource
from tinyvllm.model.loader import LoadedModel, build_model


def describe_file(f: GGUFFile) -> str:
  """The tensor types the file holds, most first (e.g. "Q4_1 x210, F32 x61, Q8_0 x1")."""
  counts: dict[str, int] = {}
  for info in f.tensors.values(): counts[blocks.type_name(info.ggml_type)] = counts.get(blocks.type_name(info.ggml_type), 0) + 1
  return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1]))


def load_gguf_model(cfg: ModelConfig, f: GGUFFile, dtype: DType, device: str, max_positions: int,
                    backend: ComputeBackend) -> LoadedModel:
  source = GGUFSource(f, cfg, dtype, device)
  model = build_model(cfg, source, device, max_positions, backend)
  # a tensor nobody read means the metadata describes a different model than the file holds
  extra = sorted(n for n in f.tensors if n not in source.used)
  if extra:
    raise ConfigError(f"{f.path}: GGUF tensor(s) that {cfg.architecture} with this metadata does not use: "
                      f"{', '.join(extra[:5])}{f' and {len(extra) - 5} more' if len(extra) > 5 else ''}")
  return LoadedModel(model, [f"gguf: {f.path.name} holds {describe_file(f)}", *source.notices()])
