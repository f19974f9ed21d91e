"""The one place that touches tinygrad internals for the hand-written kernels (tinygrad==0.14.0 is pinned).

What is internal and may change between tinygrad releases: `ProgramInfo`, the layout of an `Ops.PROGRAM` node
(SINK, LINEAR, SOURCE, BINARY), `KernelInfo`, the compiler classes (NVRTCCompiler, MetalCompiler),
`Device[...].renderer.target`, and `Device[...].runtime_t` with CUDAProgram's `smem` argument (below). Everything else
in tinyvllm/kernels uses only `Tensor` and the plans.

A kernel runs through the public `Tensor.custom_kernel`: its function returns a finished PROGRAM with a BINARY we
compiled ourselves (NVRTC to a cubin on CUDA, MetalCompiler on METAL), explicit `outs`/`ins` (without them CUDA graphs
add no dependency edge after the kernel and the JIT replays read stale data) and a fixed grid (no Variables: symbolic
launch dims break CUDA graphs). Compilers are imported only when a kernel is built for their device, so the CPU never
loads NVRTC or Metal.

Dynamic shared memory (a Launch's `shared_bytes`): tinygrad's CUDAProgram takes `smem`, sets the function's
MAX_DYNAMIC_SHARED_SIZE_BYTES attribute and launches with it (CUDA graph nodes read `runtime.smem` too), but tinygrad
builds programs as `Device[d].runtime(elf)`, without it. So `run_kernel` records the bytes under (binary, kernel name)
and wraps the device's `runtime_t` once, to build a recorded kernel with them: keyed by the binary, two
specialisations of one kernel name cannot be mixed up.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from tinygrad import Device, Tensor
from tinygrad.helpers import diskcache_get, diskcache_put
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

from tinyvllm.kernels.plan import Launch
from tinyvllm.kernels.selection import native_dialect

_lock = threading.Lock()


class KernelBuildError(RuntimeError):
  """A kernel source did not compile (the message carries the compiler's log)."""


@functools.cache
def _compiler(device: str):
  dev = Device[device]
  dialect = native_dialect(dev.device)
  if dialect == "cuda":
    from tinygrad.runtime.support.compiler_cuda import NVRTCCompiler
    # a cubin for this GPU's exact architecture (PTX from a newer NVRTC than the driver knows would not load); on
    # Hopper its architecture-specific target, sm_90a, which wgmma needs (kernels/wgmma.inc)
    return NVRTCCompiler(cuda_target(dev.arch), ptx=False, cache_key="tinyvllm_cuda")
  if dialect == "metal":
    from tinygrad.runtime.ops_metal import MetalCompiler
    return MetalCompiler()
  raise KernelBuildError(f"no hand-written kernels for device {device}")


def cuda_target(arch: str) -> str:
  """The NVRTC target for a CUDA device's `sm_XY`: Hopper's `sm_90a` (a cubin for exactly that GPU, with wgmma)."""
  return arch + "a" if arch == "sm_90" else arch


@functools.cache
def has_wgmma(device: str) -> bool:
  """Whether the device runs Hopper's warpgroup MMA (an sm_90 GPU under tinygrad's CUDA backend)."""
  return native_dialect(device) == "cuda" and cuda_target(Device[device].arch) == "sm_90a"


_binaries: dict[tuple[str, str], bytes] = {}
_dynamic_shared: dict[tuple[bytes, str], int] = {}   # (binary, kernel name) -> bytes of dynamic shared memory
_pending: set[tuple[str, str]] | None = None   # while collecting: sources met, not compiled


def compile_source(device: str, source: str) -> bytes:
  """Compile once per (device, source); tinygrad's disk cache keeps the binary across runs too."""
  if (binary := _binaries.get((device, source))) is not None: return binary
  with _lock:
    try: binary = _compiler(device).compile_cached(source)
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
  """Compile many (device, source) pairs at once: NVRTC drops the GIL, so a capture that meets a dozen new kernel
  specialisations (~0.4 s each on an H100 host) waits for about one. Binaries go to tinygrad's disk cache as
  `compile_source` would put them. Returns how many were compiled."""
  todo = []
  for device, source in dict.fromkeys(sources):
    if (device, source) in _binaries: continue
    compiler = _compiler(device)   # on this thread: Device[...] opens the GPU
    if compiler.cachekey is not None and (binary := diskcache_get(compiler.cachekey, source)) is not None:
      _binaries[(device, source)] = binary
    else: todo.append((device, source))
  def build(key: tuple[str, str]) -> bytes:
    try: return _compiler(key[0]).compile(key[1])
    except Exception as e: raise KernelBuildError(f"compiling a kernel for {key[0]} failed: {e}") from e
  with ThreadPoolExecutor(max(1, min(len(todo), workers or os.cpu_count() or 1))) as pool:
    for (device, source), binary in zip(todo, pool.map(build, todo), strict=True):
      _binaries[(device, source)] = binary
      if (key := _compiler(device).cachekey) is not None: diskcache_put(key, source, binary)
  return len(todo)


def device_arch(device: str) -> str: return str(getattr(Device[device], "arch", ""))


@functools.cache
def multiprocessor_count(device: str) -> int:
  """The SM count of a CUDA device (0 for any other): the grid of a kernel whose blocks must all be resident at once."""
  if native_dialect(device) != "cuda": return 0
  import ctypes

  from tinygrad.runtime.autogen import cuda
  count = ctypes.c_int32()
  status = cuda.cuDeviceGetAttribute(ctypes.byref(count), cuda.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, Device[device].cu_device)
  return count.value if status == 0 else 0


def dynamic_shared_bytes(binary: bytes, kernel: str) -> int:
  """Dynamic shared memory recorded for `kernel` of `binary` (0: none)."""
  return _dynamic_shared.get((binary, kernel), 0)


def record_dynamic_shared(binary: bytes, kernel: str, nbytes: int) -> None:
  """Programs built from now on for `kernel` of `binary` launch with `nbytes` of dynamic shared memory (the largest
  recorded, should a binary ever come with two sizes)."""
  key = (binary, kernel)
  _dynamic_shared[key] = max(nbytes, _dynamic_shared.get(key, 0))


class DynamicSharedRuntime:
  """A device's `runtime_t` (the program class tinygrad calls as runtime_t(device, elf)) that passes the recorded
  dynamic shared memory as `smem` to the programs that need it."""

  def __init__(self, program_class): self.program_class = program_class

  def __call__(self, dev, obj):
    smem = dynamic_shared_bytes(obj.lib, obj.name)
    return self.program_class(dev, obj, smem=smem) if smem else self.program_class(dev, obj)


def enable_dynamic_shared(dev) -> None:
  """Wrap `dev.runtime_t` (a tinygrad Compiled device) in DynamicSharedRuntime, once."""
  with _lock:
    if not isinstance(dev.runtime_t, DynamicSharedRuntime): dev.runtime_t = DynamicSharedRuntime(dev.runtime_t)


def _use_dynamic_shared(device: str, binary: bytes, launch: Launch) -> None:
  dev = Device[device]
  if native_dialect(dev.device) != "cuda": raise KernelBuildError(f"{launch.kernel}: dynamic shared memory is CUDA only")
  enable_dynamic_shared(dev)
  record_dynamic_shared(binary, launch.kernel, launch.shared_bytes)


def _program_fxn(launch: Launch, source: str, binary: bytes, device: str):
  outs = tuple(i for i, p in enumerate(launch.params) if p.written)
  ins = tuple(i for i, p in enumerate(launch.params) if not p.written)
  target = Device[device].renderer.target

  def fxn(*params: UOp) -> UOp:
    sink = UOp.sink(*params, arg=KernelInfo(name=launch.kernel))
    info = ProgramInfo(name=launch.kernel, global_size=launch.grid, local_size=(launch.threads, 1, 1),
                       globals=tuple(range(len(params))), outs=outs, ins=ins, target=target)
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=tuple(sink.toposort())), UOp(Ops.SOURCE, arg=source),
                                 UOp(Ops.BINARY, arg=binary)), arg=info)
  return fxn


def run_kernel(launch: Launch, source: str, tensors: list[Tensor]) -> list[Tensor]:
  """Launch `launch.kernel` of `source` on `tensors` (in the kernel's argument order; written ones must be buffers).
  Returns every tensor after the kernel (read the written ones through these)."""
  if len(tensors) != len(launch.params):
    raise ValueError(f"{launch.kernel} takes {len(launch.params)} tensors, got {len(tensors)}")
  for p, t in zip(launch.params, tensors, strict=True):
    if t.numel() != p.numel: raise ValueError(f"{launch.kernel}: {p.name} has {t.numel()} elements, the plan says {p.numel}")
  device = str(tensors[0].device)
  if _pending is not None and (device, source) not in _binaries:
    _pending.add((device, source))
    binary = b""
  else: binary = compile_source(device, source)
  if launch.shared_bytes and binary: _use_dynamic_shared(device, binary, launch)
  return Tensor.custom_kernel(*tensors, fxn=_program_fxn(launch, source, binary, device))


def has_buffer_identity(t: Tensor) -> bool:
  """Whether a kernel may write into `t` in place (a realized buffer, possibly after earlier writes)."""
  return t.uop.has_buffer_identity(after_ok=True)
