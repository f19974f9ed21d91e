"""Backend detection: CUDA on NVIDIA, METAL on Apple, else the CPU; --device overrides it."""
from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import threading

import tinygrad.helpers
from tinygrad import Device, Tensor
from tinygrad.dtype import DType
from tinygrad.helpers import DEV

from tinyvllm.config import ConfigError


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
  """The tinygrad device to run on (--device, else $DEV, else detection), made the default for every tensor."""
  device = requested or os.environ.get("DEV") or detect_device()
  if is_cpu(device) and not shutil.which(os.environ.get("CC", "clang")):
    raise ConfigError("the CPU backend needs a `clang` binary on PATH (e.g. `apt-get install clang`); none was found")
  if not _opens(device): raise ConfigError(f"device {device!r} is not available on this machine")
  DEV.value = device
  return Device.DEFAULT


def check_dtype(device: str, dtype: DType) -> None:
  """Fail early and clearly when the backend cannot compute in dtype (e.g. bfloat16 with an old clang on the CPU)."""
  try: (Tensor.ones(4, dtype=dtype, device=device).contiguous() + 1).realize()
  except Exception as e:
    raise ConfigError(f"the {device} backend cannot compute in {dtype.name} here ({type(e).__name__}); try --dtype float32") from None


def _per_thread_cache_connection():
  """tinygrad keeps one process-wide sqlite connection to its compile/BEAM cache, which sqlite refuses to use from a
  second thread; the async engine steps on its own thread, so every thread gets its own connection instead."""
  local = threading.local()
  original = tinygrad.helpers.db_connection

  def connection() -> sqlite3.Connection:
    if getattr(local, "conn", None) is None:
      tinygrad.helpers._db_connection = None
      local.conn = original()
      tinygrad.helpers._db_connection = None
    return local.conn
  return connection


if not getattr(tinygrad.helpers.db_connection, "per_thread", False):
  tinygrad.helpers.db_connection = _per_thread_cache_connection()
  tinygrad.helpers.db_connection.per_thread = True  # type: ignore[attr-defined]
