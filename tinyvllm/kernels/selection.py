"""Choosing the attention backend at start-up: hand-written kernels where they run, the portable path elsewhere.

  auto      CUDA device -> cuda kernels, METAL device -> metal kernels, anything else -> portable; if the kernels fail
            to build on their device, portable (the reason is logged)
  portable  the tinygrad-ops path on every device
  cuda      the CUDA kernels; an error unless the device is CUDA (or they fail to build)
  metal     the Metal kernels; an error unless the device is METAL (or they fail to build)

The kernel modules (and with them NVRTC or Metal's compiler) are imported only for a CUDA or METAL device.
"""
from __future__ import annotations

from tinyvllm.config import ATTENTION_BACKENDS as BACKEND_CHOICES
from tinyvllm.config import ConfigError


def native_dialect(device: str) -> str | None:
  """The kernel dialect for a tinygrad device name (CUDA, CUDA:PTX, METAL, ...), None where there is none."""
  return {"CUDA": "cuda", "METAL": "metal"}.get(device.split(":")[0].upper())


def select_attention_backend(requested: str, device: str, probe: bool = True):
  """The backend object for `device` (a PortableBackend or a FusedBackend). `probe` compiles the KV write kernel once
  so that a missing compiler shows up at start-up rather than in the first step."""
  from tinyvllm.kernels.portable import PortableBackend
  if requested not in BACKEND_CHOICES:
    raise ConfigError(f"attention backend must be one of {', '.join(BACKEND_CHOICES)}, got {requested!r}")
  if requested == "portable": return PortableBackend("requested with --attention-backend portable")
  dialect = native_dialect(device)
  if requested != "auto" and dialect != requested:
    raise ConfigError(f"--attention-backend {requested} needs a {requested.upper()} device, but the engine runs on {device} "
                      f"(use auto or portable here)")
  if dialect is None: return PortableBackend(f"no hand-written kernels for {device.split(':')[0]}")
  try:
    from tinyvllm.kernels.fused import FusedBackend
    backend = FusedBackend(dialect, device)
    if probe: _probe(dialect, device)
    return backend
  except Exception as e:
    if requested != "auto": raise ConfigError(f"the {dialect} attention kernels cannot be built on {device}: {e}") from e
    return PortableBackend(f"the {dialect} kernels failed to build ({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def _probe(dialect: str, device: str) -> None:
  from tinyvllm.kernels.plan import write_plan
  from tinyvllm.kernels.sources import kernel_source
  from tinyvllm.kernels.tinygrad_program import compile_source
  compile_source(device, kernel_source(dialect, "kv_write", write_plan("float32", 4, 1, 1).defines))
