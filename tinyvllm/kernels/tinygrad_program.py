"""Compiling and launching the hand-written kernels through tinygrad (its internals: tinyvllm/platform/tinygrad_compat.py).

A kernel runs through the public `Tensor.custom_kernel`: its function returns a finished PROGRAM with a BINARY we
compiled ourselves (NVRTC to a cubin for the GPU's exact architecture on CUDA, MetalCompiler on METAL) and a fixed
grid. Compilers are created only when a kernel is built for their device, so the CPU never loads NVRTC or Metal.
Binaries are kept per (device, source) here and in tinygrad's disk cache across runs; before a step is captured, its
new sources can be collected without compiling and compiled in parallel threads (NVRTC drops the GIL).

Dynamic shared memory (a Launch's `shared_bytes`, CUDA): recorded per (binary, kernel) so that tinygrad's CUDA program
launches with it.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from tinygrad import Tensor, dtypes

from tinyvllm.kernels.plan import Launch
from tinyvllm.platform import tinygrad_compat as compat
from tinyvllm.platform.target import DeviceTarget, detect_target

_lock = threading.Lock()


class KernelBuildError(RuntimeError):
  """A kernel source did not compile (the message carries the compiler's log)."""


@functools.cache
def device_target(device: str) -> DeviceTarget:
  """The target of a device (read once per device)."""
  return detect_target(device)


@functools.cache
def zeroed_counters(device: str | tuple[str, ...], numel: int) -> Tensor:
  """Zeroed uint32 counters for a kernel whose last block to arrive finishes its work (a split decode's merge, a split
  sampling row): one buffer a device and size, shared by every launch and kernel that takes it, since each leaves it
  zero and runs after the one before on its device's stream."""
  return Tensor.zeros(numel, dtype=dtypes.uint32, device=device).contiguous().realize()


@functools.cache
def _compiler(device: str):
  target = device_target(device)
  if target.dialect is None: raise KernelBuildError(f"no hand-written kernels for device {device}")
  return compat.kernel_compiler(target.dialect, target.cuda_target)


_binaries: dict[tuple[str, str], bytes] = {}
_pending: set[tuple[str, str]] | None = None   # while collecting: sources met, not compiled


def compile_source(device: str, source: str) -> bytes:
  """Compile once per (device, source); tinygrad's disk cache keeps the binary across runs too."""
  if (binary := _binaries.get((device, source))) is not None: return binary
  with _lock:
    try: binary = compat.compile_cached(_compiler(device), source)
    except Exception as e: raise KernelBuildError(f"compiling a kernel for {device} failed: {e}") from e
  _binaries[(device, source)] = binary
  return binary


@contextlib.contextmanager
def collecting_sources() -> Iterator[set[tuple[str, str]]]:
  """While inside, `run_kernel` compiles nothing and records each (device, source) it has no binary for; the graphs
  built meanwhile carry no binaries and must not be realized. For `compile_parallel` ahead of the real build."""
  global _pending
  previous, _pending = _pending, set()
  try: yield _pending
  finally: _pending = previous


def compile_parallel(sources: Iterable[tuple[str, str]], workers: int | None = None) -> int:
  """Compile many (device, source) pairs at once: a capture that meets a dozen new kernel specialisations (~0.4 s each
  on an H100 host) waits for about one. Returns how many were compiled."""
  todo = []
  for device, source in dict.fromkeys(sources):
    if (device, source) in _binaries: continue
    compiler = _compiler(device)   # on this thread: Device[...] opens the GPU
    if (binary := compat.disk_cached_binary(compiler, source)) is not None: _binaries[(device, source)] = binary
    else: todo.append((device, source))

  def build(key: tuple[str, str]) -> bytes:
    try: return compat.compile_uncached(_compiler(key[0]), key[1])
    except Exception as e: raise KernelBuildError(f"compiling a kernel for {key[0]} failed: {e}") from e
  with ThreadPoolExecutor(max(1, min(len(todo), workers or os.cpu_count() or 1))) as pool:
    for (device, source), binary in zip(todo, pool.map(build, todo), strict=True):
      _binaries[(device, source)] = binary
      compat.disk_cache_binary(_compiler(device), source, binary)
  return len(todo)


def run_kernel(launch: Launch, source: str, tensors: list[Tensor]) -> list[Tensor]:
  """Launch `launch.kernel` of `source` on `tensors` (in the kernel's argument order; written ones must be buffers).
  Returns every tensor after the kernel (read the written ones through these)."""
  if len(tensors) != len(launch.params):
    raise ValueError(f"{launch.kernel} takes {len(launch.params)} tensors, got {len(tensors)}")
  for p, t in zip(launch.params, tensors, strict=True):
    if t.numel() != p.numel: raise ValueError(f"{launch.kernel}: {p.name} has {t.numel()} elements, the plan says {p.numel}")
  # a tensor-parallel shard's tensors are on every device of its group: the kernel runs on each (one binary, the devices
  # being alike)
  devices = tensors[0].device if isinstance(tensors[0].device, tuple) else (str(tensors[0].device),)
  device = devices[0]
  if _pending is not None and (device, source) not in _binaries:
    _pending.add((device, source))
    binary = b""
  else: binary = compile_source(device, source)
  if launch.shared_bytes and binary:
    if device_target(device).dialect != "cuda": raise KernelBuildError(f"{launch.kernel}: dynamic shared memory is CUDA only")
    for d in devices: compat.use_dynamic_shared(d, binary, launch.kernel, launch.shared_bytes)
  if binary and device_target(device).dialect == "cuda":   # every kernel of ours begins with TV_WAIT_PRIOR_GRIDS
    for d in devices: compat.launch_programmatically(d, binary, launch.kernel)
  outs = tuple(i for i, p in enumerate(launch.params) if p.written)
  ins = tuple(i for i, p in enumerate(launch.params) if not p.written)
  return Tensor.custom_kernel(*tensors, fxn=compat.program(launch.kernel, launch.grid, launch.threads, outs, ins, source,
                                                           binary, device))


def has_buffer_identity(t: Tensor) -> bool:
  """Whether a kernel may write into `t` in place (a realized buffer, possibly after earlier writes)."""
  return compat.has_buffer_identity(t)
