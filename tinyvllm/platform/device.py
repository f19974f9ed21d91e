"""Backend detection: CUDA on NVIDIA, METAL on Apple, else the CPU; --device overrides it."""
from __future__ import annotations

import shutil
import sys

from tinygrad import Device, Tensor
from tinygrad.dtype import DType

from tinyvllm.config import ConfigError, cpu_c_compiler
from tinyvllm.platform import tinygrad_compat as compat


def _opens(name: str) -> bool:
  try:
    Device[name]
    return True
  except Exception:  # tinygrad raises many kinds of errors for a backend that cannot start
    return False


def detect_device() -> str:
  if sys.platform == "darwin" and _opens("METAL"): return "METAL"
  # On Hopper, tinygrad's own NV driver does not start; the CUDA backend (libcuda + NVRTC) does.
  if shutil.which("nvidia-smi") and _opens("CUDA"): return "CUDA"
  return "CPU"


def is_cpu(device: str) -> bool: return device.split(":")[0].upper() == "CPU"


def select_device(requested: str | None) -> str:
  """The tinygrad device to run on (requested, else detected), made the default for every tensor."""
  device = requested or detect_device()
  if is_cpu(device) and not shutil.which(cpu_c_compiler()):
    raise ConfigError(f"the CPU backend needs a `{cpu_c_compiler()}` binary on PATH (e.g. `apt-get install clang`); none was found")
  if not _opens(device): raise ConfigError(f"device {device!r} is not available on this machine")
  return compat.set_default_device(device)


def check_dtype(device: str, dtype: DType) -> None:
  """Fail early and clearly when the backend cannot compute in dtype (e.g. bfloat16 with an old clang on the CPU)."""
  try: (Tensor.ones(4, dtype=dtype, device=device).contiguous() + 1).realize()
  except Exception as e:
    raise ConfigError(f"the {device} backend cannot compute in {dtype.name} here ({type(e).__name__}); try --dtype float32") from None
