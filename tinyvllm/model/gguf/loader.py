"""Building the model from a GGUF file: its metadata's config, its tensors through GGUFSource, every tensor used."""
from __future__ import annotations

from collections import Counter

from tinygrad.dtype import DType

from tinyvllm.backend.interface import ComputeBackend
from tinyvllm.layers.tensor_parallel import TensorParallelGroup
from tinyvllm.model.gguf import blocks
from tinyvllm.model.gguf.config import CONFIG_TENSORS
from tinyvllm.model.gguf.reader import GGUFFile
from tinyvllm.model.gguf.source import GGUFSource
from tinyvllm.model.loader import LoadedModel, build_model, check_all_used
from tinyvllm.model_config import ModelConfig


def describe_file(f: GGUFFile) -> str:
  """The tensor types the file holds, most first (e.g. "Q4_1 x210, F32 x61, Q8_0 x1")."""
  counts = Counter(blocks.type_name(info.ggml_type) for info in f.tensors.values())
  return ", ".join(f"{n} x{c}" for n, c in counts.most_common())


def load_gguf_model(cfg: ModelConfig, f: GGUFFile, dtype: DType, device: str, max_positions: int,
                    backend: ComputeBackend, group: TensorParallelGroup | None = None) -> LoadedModel:
  source = GGUFSource(f, cfg, dtype, device)
  model = build_model(cfg, source, device, max_positions, backend, group)
  # a tensor nobody read means the metadata describes a different model than the file holds
  check_all_used(sorted(n for n in f.tensors if n not in source.used and n not in CONFIG_TENSORS),
                 f"{f.path}: GGUF tensor(s) that {cfg.architecture} with this metadata does not use")
  splits = f" (and its {len(f.splits) - 1} other splits)" if len(f.splits) > 1 else ""
  return LoadedModel(model, [f"gguf: {f.path.name}{splits} holds {describe_file(f)}", *source.notices()])
