"""Choosing the compute backend at engine start: hand-written kernels where they run, the portable path elsewhere.

  auto      CUDA device -> cuda kernels, METAL device -> metal kernels, anything else -> portable; portable too where
            the kernels' capabilities do not cover the model and settings, or they fail to build (the reason is logged)
  portable  the tinygrad-ops path on every device
  cuda      the CUDA kernels; an error unless the device is CUDA, they cover the model and settings, and they build
  metal     the Metal kernels; likewise on METAL

The device's facts are read once here (its DeviceTarget) and the capability record is checked once; the kernel
compilers (NVRTC, Metal's) are loaded only for a CUDA or METAL device.
"""
from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.backend.interface import ComputeBackend
from tinyvllm.config import ATTENTION_BACKENDS, ConfigError, KernelOptions
from tinyvllm.layers.portable import PortableBackend
from tinyvllm.platform.target import native_dialect


@dataclass(frozen=True)
class BackendRequest:
  """What the backend must run: the activations' dtype, the KV cache's ("auto" or "fp8_e4m3"), the model's head size,
  the cache's block size, the MLP's gated activation (HF's hidden_act name)."""
  dtype: str
  kv_cache_dtype: str
  head_size: int
  block_size: int
  activation: str = "silu"


def select_backend(requested: str, device: str, request: BackendRequest, options: KernelOptions | None = None,
                   probe: bool = True) -> ComputeBackend:
  """The backend for `device` (a PortableBackend or a FusedBackend). `probe` compiles the KV write kernel once so that
  a missing compiler shows up at start-up rather than in the first step."""
  if requested not in ATTENTION_BACKENDS:
    raise ConfigError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
  if requested == "portable": return PortableBackend("requested with --attention-backend portable")
  dialect = native_dialect(device)
  if requested != "auto" and dialect != requested:
    raise ConfigError(f"--attention-backend {requested} needs a {requested.upper()} device, but the engine runs on {device} "
                      f"(use auto or portable here)")
  if dialect is None: return PortableBackend(f"no hand-written kernels for {device.split(':')[0]}")
  try:
    from tinyvllm.kernels.fused import FusedBackend
    from tinyvllm.kernels.tinygrad_program import device_target
    backend = FusedBackend(device_target(device), options)
    reason = backend.capabilities.unsupported_reason(request.dtype, request.kv_cache_dtype, request.head_size, request.block_size,
                                                     request.activation)
    if reason is not None: raise ConfigError(f"the {dialect} kernels do not take {reason}")
    if probe: _probe(device)
    return backend
  except Exception as e:
    if requested != "auto": raise ConfigError(f"the {dialect} kernels cannot run here: {e}") from e
    return PortableBackend(f"the {dialect} kernels cannot run here ({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def _probe(device: str) -> None:
  from tinyvllm.kernels.plan import write_plan
  from tinyvllm.kernels.sources import kernel_source
  from tinyvllm.kernels.tinygrad_program import compile_source, device_target
  compile_source(device, kernel_source(device_target(device).dialect, "kv_write", write_plan("float32", 4, 1, 1).defines))
