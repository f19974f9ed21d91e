"""Backend detection: CUDA on NVIDIA, METAL on Apple, else the CPU; --device overrides it."""
from __future__ import annotations

import shutil
import sys

from tinygrad import Device, Tensor
from tinygrad.dtype import DType

from tinyvllm.config import ConfigError, cpu_c_compiler
from tinyvllm.platform import tinygrad_compat as compat


def opens(name: str) -> bool:
  try:
    Device[name]
    return True
  except Exception:  # tinygrad raises many kinds of errors for a backend that cannot start
    return False


def detect_device() -> str:
  if sys.platform == "darwin" and opens("METAL"): return "METAL"
  # On Hopper, tinygrad's own NV driver does not start; the CUDA backend (libcuda + NVRTC) does.
  if shutil.which("nvidia-smi") and opens("CUDA"): return "CUDA"
  return "CPU"


def is_cpu(device: str) -> bool: return device.split(":")[0].upper() == "CPU"


def check_device_name(device: str) -> str:
  """`device` as tinygrad's DEV takes it (BACKEND or BACKEND:RENDERER; BACKEND:0 is BACKEND); anything else is refused,
  naming it (tinygrad reads the part after the colon as a renderer, so "CPU:1" would otherwise fail later, at the first
  kernel, with an unrelated error)."""
  backend, _, suffix = device.partition(":")
  known = compat.backend_names()
  if backend.upper() not in known:
    raise ConfigError(f"device {device!r}: {backend!r} is not a tinygrad backend (tinygrad has {', '.join(sorted(known))})")
  if suffix in ("", "0"): return backend
  if suffix.isdigit():
    raise ConfigError(f"device {device!r}: device indices are not supported; tinyvllm runs on one device, the backend's "
                      "first (pick a GPU with CUDA_VISIBLE_DEVICES)")
  if not opens(backend): raise ConfigError(f"device {device!r} is not available on this machine")
  renderers = compat.renderer_names(backend)
  if suffix.upper() not in renderers:
    raise ConfigError(f"device {device!r}: {backend.upper()} has no renderer {suffix!r} (it has {', '.join(renderers)}); "
                      "a device is BACKEND or BACKEND:RENDERER")
  return device


def select_device(requested: str | None) -> str:
  """The tinygrad device to run on (requested, else detected), made the default for every tensor."""
  device = check_device_name(requested) if requested else detect_device()
  if is_cpu(device) and not shutil.which(cpu_c_compiler()):
    raise ConfigError(f"the CPU backend needs a `{cpu_c_compiler()}` binary on PATH (e.g. `apt-get install clang`); none was found")
  if not opens(device): raise ConfigError(f"device {device!r} is not available on this machine")
  return compat.set_default_device(device)


def check_dtype(device: str, dtype: DType) -> None:
  """Fail early and clearly when the backend cannot compute in dtype (e.g. bfloat16 with an old clang on the CPU)."""
  try: (Tensor.ones(4, dtype=dtype, device=device).contiguous() + 1).realize()
  except Exception as e:
    raise ConfigError(f"the {device} backend cannot compute in {dtype.name} here ({type(e).__name__}); try --dtype float32") from None
