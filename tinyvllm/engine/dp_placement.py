"""Where the data-parallel replicas run on this host (executor mp): replica i gets the GPUs i x tp .. i x tp + tp - 1,
made its only visible ones with CUDA_VISIBLE_DEVICES as vLLM sets each data-parallel engine's (so that inside the
replica they are CUDA:0 .. CUDA:tp-1, where tensor parallelism takes its consecutive devices from); on the CPU every
replica uses the CPU. Read without opening a device in the API process (no CUDA context there): the backend is
--device's, else CUDA where nvidia-smi lists a GPU, METAL on a Mac, else the CPU.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

from tinyvllm.config import ConfigError, EngineConfig, cuda_visible_devices

NVIDIA_SMI_TIMEOUT_S = 30


def cuda_devices() -> list[str] | None:
  """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES names them (its entries where it is set, else
  nvidia-smi's indices); None where that cannot be read (no nvidia-smi)."""
  smi = shutil.which("nvidia-smi")
  if smi is None: return None
  try: listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False).stdout
  except (OSError, subprocess.SubprocessError): return None
  count = sum(line.startswith("GPU ") for line in listing.splitlines())
  visible = cuda_visible_devices()
  if visible is not None: return visible[:count]
  return [str(i) for i in range(count)]


def replica_backend(config: EngineConfig, gpus: list[str] | None) -> str:
  """The backend the replicas will detect (or the one --device names), upper case."""
  if config.device: return config.device.partition(":")[0].upper()
  if sys.platform == "darwin": return "METAL"
  return "CUDA" if gpus else "CPU"


def replica_environments(config: EngineConfig) -> list[dict[str, str]]:
  """Per replica, the environment its process starts with; ConfigError when this host has too few devices."""
  dp, tp = config.data_parallel_size, config.tensor_parallel_size
  gpus = cuda_devices()
  backend = replica_backend(config, gpus)
  if backend == "CPU": return [{} for _ in range(dp)]
  if backend != "CUDA":
    if dp == 1: return [{}]
    raise ConfigError(f"data_parallel_size {dp}: data-parallel replicas run on CUDA devices or the CPU, not on {backend} "
                      "(one replica a device needs the device's index, which this backend does not take)")
  need = dp * tp
  if gpus is None: gpus = [str(i) for i in range(need)]   # nvidia-smi is missing: the replicas will say what is wrong
  if need > len(gpus):
    raise ConfigError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs {need} CUDA devices; this machine has "
                      f"{len(gpus)} visible ({', '.join(gpus) or 'none'}): pass --data-parallel-size {len(gpus) // tp or 1}")
  return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp:(i + 1) * tp])} for i in range(dp)]
