"""How many KV blocks to allocate: --num-gpu-blocks, else --kv-cache-memory, else --gpu-memory-utilization where the
backend can tell its free memory, else enough for max_num_seqs full contexts (capped at DEFAULT_BUDGET); and how many
blocks the swap space in host memory holds (--swap-space)."""
from __future__ import annotations

from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.platform import tinygrad_compat as compat

GiB = 1 << 30
DEFAULT_BUDGET = 2 * GiB


def device_memory(device: str) -> tuple[int, int] | None:
  """(free, total) bytes on a CUDA device, or None where the backend cannot say."""
  return compat.cuda_memory(device) if device.startswith("CUDA") else None


def num_kv_blocks(config: EngineConfig, device: str, block_bytes: int, tokens_per_block: int, max_model_len: int) -> int:
  """Blocks of `tokens_per_block` tokens (block_bytes each, all layers) that the KV cache gets."""
  if config.num_gpu_blocks is not None: return config.num_gpu_blocks
  if config.kv_cache_memory is not None: budget = int(config.kv_cache_memory * GiB)
  elif (memory := device_memory(device)) is not None:
    free, total = memory
    budget = int(free - (1 - config.gpu_memory_utilization) * total)
  else:
    wanted = config.max_num_seqs * -(-max_model_len // tokens_per_block) * block_bytes
    budget = min(wanted, DEFAULT_BUDGET)
  blocks = budget // block_bytes
  if blocks < 1:
    raise ConfigError(f"the KV cache budget ({budget / GiB:.3f} GiB) is smaller than one block ({block_bytes} bytes); "
                      "raise --kv-cache-memory or --gpu-memory-utilization")
  return blocks


def num_swap_blocks(config: EngineConfig, block_bytes: int) -> int:
  """The swap space's blocks (--swap-space GiB of host memory) for --preemption-mode swap; none otherwise."""
  if config.preemption_mode != "swap": return 0
  blocks = int(config.swap_space * GiB) // block_bytes
  if blocks < 1:
    raise ConfigError(f"swap_space ({config.swap_space} GiB) is smaller than one KV block ({block_bytes} bytes); raise --swap-space")
  return blocks
