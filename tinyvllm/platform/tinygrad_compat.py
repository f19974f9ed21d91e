"""Every use of tinygrad internals but the compile cache's (compile_cache.py), in one module (tinygrad==0.14.0 is pinned).

Everywhere else tinyvllm uses tinygrad's public API: Tensor, dtypes, Device, TinyJit, and `Tensor.custom_kernel` with
its UOp DSL. What it needs beyond that is here, with the reason:
- kernels it compiles itself: a PROGRAM node (`ProgramInfo`, SINK / LINEAR / SOURCE / BINARY), the NVRTC and Metal
  compiler classes, tinygrad's disk cache, a device's renderer target, and `runtime_t` wrapped so that a program
  launches with dynamic shared memory (tinygrad builds programs as `runtime(elf)`, without CUDAProgram's `smem`);
- a realized buffer's device address and whether CUDA devices reach each other's memory (the peer all-reduce);
- a step's two copies without the scheduler: a Buffer's allocator `_copyin` / `_copyout`, and on CUDA pinned host
  memory (also arrays over it that a copy in reads directly), an event and the device's `pending_copyin` list (freed
  by tinygrad only on a full synchronize);
- device facts: the CUDA driver's device attributes and free memory, a device's `arch`, the backends tinygrad has
  (`Device._devices`) and a backend's renderer names (`_renderer_name`, the second part of a DEV target);
- TinyJit capturing on its first call (`cnt`), the default device (`DEV`), `GlobalCounters.mem_used`;
- one patch, `install()`: tinygrad's process-wide sqlite cache connection becomes one per thread (sqlite refuses a
  connection from a second thread, and the async engine steps on its own);
- the compile cache's (tinyvllm/platform/compile_cache.py, `install_disk_caches()`): tinygrad's schedule and program
  caches backed by its disk cache.

`check(device)` touches every one of them and raises CompatError naming what is missing, so that a tinygrad upgrade
fails at engine start (and in tests/test_tinygrad_compat.py), not in the middle of a step.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import tinygrad.helpers
from tinygrad import Device, Tensor, TinyJit
from tinygrad.device import Buffer, BufferSpec
from tinygrad.dtype import _to_np_dtype
from tinygrad.helpers import DEV, ContextVar, GlobalCounters, diskcache_get, diskcache_put
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

from tinyvllm.platform.compile_cache import caches_present, tinygrad_version

__all__ = ["KernelInfo", "Ops", "UOp"]   # the UOp DSL names the scatter kernels use (tinyvllm/layers/scatter.py)
_lock = threading.Lock()


class CompatError(RuntimeError):
  """The installed tinygrad lacks an internal tinyvllm relies on (tinygrad==0.14.0 is the supported version)."""


def check(device: str | None = None) -> None:
  """Touch every internal used here (the CUDA ones where `device` is CUDA); raise CompatError naming a missing one."""
  wanted = {"ProgramInfo fields": lambda: {"name", "global_size", "local_size", "globals", "outs", "ins", "target"}
            <= {f.name for f in dataclasses.fields(ProgramInfo)},
            "Ops.PROGRAM/LINEAR/SOURCE/BINARY/RESHAPE": lambda: all(hasattr(Ops, o) for o in
                                                                   ("PROGRAM", "LINEAR", "SOURCE", "BINARY", "RESHAPE")),
            "helpers.db_connection": lambda: callable(tinygrad.helpers.db_connection)
            and hasattr(tinygrad.helpers, "_db_connection"),
            "TinyJit.cnt": lambda: hasattr(TinyJit(lambda: None), "cnt"),
            "DEV.value": lambda: hasattr(DEV, "value"),
            "Device._devices": lambda: "CPU" in backend_names(),
            "Buffer.allocate / ensure_allocated / _buf": lambda: hasattr(Buffer, "allocate") and hasattr(Buffer, "ensure_allocated"),
            "GlobalCounters.mem_used": lambda: isinstance(GlobalCounters.mem_used, int),
            "UOp.has_buffer_identity": lambda: hasattr(UOp, "has_buffer_identity"),
            "Tensor.custom_kernel": lambda: hasattr(Tensor, "custom_kernel"),
            "schedule_cache / to_program_cache / to_program_key": caches_present,
            "ContextVar._cache": lambda: isinstance(ContextVar._cache, dict) and "SCACHE" in ContextVar._cache}
  if device is not None and device.split(":")[0] == "CUDA":
    wanted.update({"autogen.cuda": _cuda_bindings_present, "NVRTCCompiler": lambda: _nvrtc_class() is not None,
                   "CUDA device context / pending_copyin / cu_device": lambda: all(
                     hasattr(Device[device], a) for a in ("context", "pending_copyin", "cu_device", "arch")),
                   "CUDAGraph nodes / graph / instance, GraphRunner calls / runtimes": _graph_internals_present})
  for what, probe in wanted.items():
    try: ok = probe()
    except Exception as e: ok, what = False, f"{what} ({type(e).__name__}: {e})"
    if not ok: raise CompatError(f"tinygrad {_version()} lacks {what}, which tinyvllm uses (it supports tinygrad==0.14.0)")


def _graph_internals_present() -> bool:
  from tinyvllm.platform import cuda_graph
  return cuda_graph.internals_present()


def _version() -> str: return tinygrad_version()


def install() -> None:
  """The one patch: a tinygrad compile/BEAM cache connection per thread (idempotent)."""
  if getattr(tinygrad.helpers.db_connection, "per_thread", False): return
  local, original = threading.local(), tinygrad.helpers.db_connection

  def connection() -> sqlite3.Connection:
    if getattr(local, "conn", None) is None:
      tinygrad.helpers._db_connection = None
      local.conn = original()
      tinygrad.helpers._db_connection = None
    return local.conn
  connection.per_thread = True  # type: ignore[attr-defined]
  tinygrad.helpers.db_connection = connection


# ---- devices

def set_default_device(device: str) -> str:
  """Make `device` the default of every new tensor; returns tinygrad's canonical name for it."""
  DEV.value = device
  return Device.DEFAULT


def backend_names() -> list[str]:
  """Every backend tinygrad has (CPU, CUDA, METAL, ...), whether or not it opens here."""
  return list(Device._devices)


def renderer_names(backend: str) -> list[str]:
  """The renderers a backend can compile with (the RENDERER of DEV=BACKEND:RENDERER); opens the backend."""
  dev = Device[backend]
  return [dev._renderer_name(r) for r in dev.renderers]


def device_arch(device: str) -> str: return str(getattr(Device[device], "arch", ""))


def cuda_attribute(device: str, name: str) -> int:
  """A CUDA device attribute (`CU_DEVICE_ATTRIBUTE_<name>`), 0 where it cannot be read."""
  from tinygrad.runtime.autogen import cuda
  value = ctypes.c_int32()
  status = cuda.cuDeviceGetAttribute(ctypes.byref(value), getattr(cuda, f"CU_DEVICE_ATTRIBUTE_{name}"), Device[device].cu_device)
  return value.value if status == 0 else 0


def cuda_memory(device: str) -> tuple[int, int] | None:
  """(free, total) bytes of a CUDA device, None where the driver cannot say."""
  try:
    from tinygrad.runtime.autogen import cuda
    Device[device].synchronize()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0: return None
    return free.value, total.value
  except Exception:  # no CUDA bindings or no context
    return None


def _cuda_bindings_present() -> bool:
  from tinygrad.runtime.autogen import cuda
  return all(hasattr(cuda, f) for f in ("cuDeviceGetAttribute", "cuMemGetInfo_v2", "cuMemcpyDtoHAsync_v2", "cuEventCreate",
                                        "cuEventRecord", "cuEventSynchronize", "cuEventDestroy_v2", "cuCtxSetCurrent"))


def _nvrtc_class():
  from tinygrad.runtime.support.compiler_cuda import NVRTCCompiler
  return NVRTCCompiler


# ---- hand-compiled kernels

def kernel_compiler(dialect: str, cuda_target: str = ""):
  """NVRTC to a cubin for `cuda_target` (e.g. sm_90a) on CUDA, MetalCompiler on Metal; both cache on disk."""
  if dialect == "cuda": return _nvrtc_class()(cuda_target, ptx=False, cache_key="tinyvllm_cuda")
  if dialect == "metal":
    from tinygrad.runtime.ops_metal import MetalCompiler
    return MetalCompiler()
  raise ValueError(f"no kernel compiler for dialect {dialect!r}")


def compile_cached(compiler, source: str) -> bytes: return compiler.compile_cached(source)


def compile_uncached(compiler, source: str) -> bytes: return compiler.compile(source)


def disk_cached_binary(compiler, source: str) -> bytes | None:
  return diskcache_get(compiler.cachekey, source) if compiler.cachekey is not None else None


def disk_cache_binary(compiler, source: str, binary: bytes) -> None:
  if compiler.cachekey is not None: diskcache_put(compiler.cachekey, source, binary)


def program(name: str, grid: tuple[int, int, int], threads: int, outs: tuple[int, ...], ins: tuple[int, ...], source: str,
            binary: bytes, device: str) -> Callable[..., UOp]:
  """A custom_kernel function returning a finished PROGRAM: our binary, explicit outs/ins (without them CUDA graphs add
  no dependency edge after the kernel) and a fixed grid (symbolic launch dims break CUDA graphs)."""
  target = Device[device].renderer.target

  def fxn(*params: UOp) -> UOp:
    sink = UOp.sink(*params, arg=KernelInfo(name=name))
    info = ProgramInfo(name=name, global_size=grid, local_size=(threads, 1, 1), globals=tuple(range(len(params))), outs=outs,
                       ins=ins, target=target)
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=tuple(sink.toposort())), UOp(Ops.SOURCE, arg=source),
                                 UOp(Ops.BINARY, arg=binary)), arg=info)
  return fxn


_dynamic_shared: dict[tuple[bytes, str], int] = {}   # (binary, kernel name) -> bytes of dynamic shared memory


def dynamic_shared_bytes(binary: bytes, kernel: str) -> int: return _dynamic_shared.get((binary, kernel), 0)


class DynamicSharedRuntime:
  """A device's `runtime_t` (called as runtime_t(device, elf)) passing the recorded dynamic shared memory as `smem`."""

  def __init__(self, program_class): self.program_class = program_class

  def __call__(self, dev, obj):
    smem = dynamic_shared_bytes(obj.lib, obj.name)
    return self.program_class(dev, obj, smem=smem) if smem else self.program_class(dev, obj)


def use_dynamic_shared(device: str, binary: bytes, kernel: str, nbytes: int) -> None:
  """Programs built from now on for `kernel` of `binary` on a CUDA device launch with `nbytes` of dynamic shared
  memory (the largest recorded); keyed by the binary, two specialisations of one kernel name cannot be mixed up."""
  dev = Device[device]
  with _lock:
    if not isinstance(dev.runtime_t, DynamicSharedRuntime): dev.runtime_t = DynamicSharedRuntime(dev.runtime_t)
    _dynamic_shared[(binary, kernel)] = max(nbytes, _dynamic_shared.get((binary, kernel), 0))


def launch_programmatically(device: str, binary: bytes, kernel: str) -> None:
  """`kernel` of `binary` begins with TV_WAIT_PRIOR_GRIDS: CUDA graphs on `device` (sm_90+) may launch it while the
  kernel before it finishes (platform/cuda_graph.py)."""
  from tinyvllm.platform import cuda_graph
  if cuda_graph.use_programmatic_graphs(device): cuda_graph.mark_waiting(binary, kernel)


# ---- buffers and copies

def has_buffer_identity(t: Tensor) -> bool:
  """Whether a kernel may write into `t` in place (a realized buffer, possibly after earlier writes)."""
  return t.uop.has_buffer_identity(after_ok=True)


def copy_in(t: Tensor, data: np.ndarray, offset_bytes: int = 0) -> None:
  """Copy `data` (contiguous) straight into realized tensor t's buffer through its allocator, from `offset_bytes` on."""
  buf = t.uop.buffer.ensure_allocated()
  allocator, view = Device[str(t.device)].allocator, memoryview(data).cast("B")
  if offset_bytes + view.nbytes > buf.nbytes: raise ValueError(f"{view.nbytes} bytes at {offset_bytes} pass the buffer's {buf.nbytes}")
  dest = allocator._offset(buf._buf, view.nbytes, offset_bytes) if offset_bytes else buf._buf
  allocator._copyin(dest, view)


def pinned_array(device: str, shape: tuple[int, ...], dtype: type = np.int32) -> np.ndarray:
  """A numpy array over pinned (page-locked) host memory of CUDA device `device`, which `copy_in_pinned` copies from
  directly. The memory goes back to the device's allocator once no array over it is left (its engine gone)."""
  dev, nbytes, spec = Device[device], math.prod(shape) * np.dtype(dtype).itemsize, BufferSpec(host=True)
  host = dev.allocator.alloc(nbytes, spec)
  memory = (ctypes.c_byte * nbytes).from_address(host.value)   # every view of the array keeps it alive
  weakref.finalize(memory, dev.allocator.free, host, nbytes, spec)
  return np.frombuffer(memory, dtype).reshape(shape)


def copy_in_pinned(t: Tensor, data: np.ndarray, offset_bytes: int = 0) -> None:
  """`copy_in` from an array of `pinned_array` (or a contiguous part of one): the device reads it directly, on the
  stream the steps run on, without tinygrad's staging copy of it. It reads it after the work enqueued before, so the
  array must not change until that copy has run (the step that reads it has finished)."""
  from tinygrad.runtime.autogen import cuda
  from tinygrad.runtime.ops_cuda import check as cuda_check
  buf, dev = t.uop.buffer.ensure_allocated(), Device[str(t.device)]
  if offset_bytes + data.nbytes > buf.nbytes: raise ValueError(f"{data.nbytes} bytes at {offset_bytes} pass the buffer's {buf.nbytes}")
  dest = dev.allocator._offset(buf._buf, data.nbytes, offset_bytes) if offset_bytes else buf._buf
  cuda_check(cuda.cuCtxSetCurrent(dev.context))
  cuda_check(cuda.cuMemcpyHtoDAsync_v2(dest, data.ctypes.data, data.nbytes, None))


def device_address(t: Tensor) -> int:
  """The device address of realized tensor t's buffer (a CUDA device pointer), for a kernel that reads it from another
  device (tinyvllm/kernels/all_reduce.py)."""
  buf = t.uop.buffer.ensure_allocated()._buf
  return int(getattr(buf, "value", buf))


def peers_accessible(devices: tuple[str, ...]) -> bool:
  """Whether every CUDA device of `devices` can read every other's memory: tinygrad enables peer access between each
  pair the driver allows as it opens the devices, so once all are open this is what the driver says."""
  if any(d.split(":")[0] != "CUDA" for d in devices): return False
  from tinygrad.runtime.autogen import cuda
  from tinygrad.runtime.ops_cuda import check as cuda_check
  opened = [Device[d] for d in devices]
  for a in opened:
    for b in opened:
      if a is b: continue
      cuda_check(cuda.cuDeviceCanAccessPeer(ctypes.byref(can := ctypes.c_int()), a.cu_device, b.cu_device))
      if can.value != 1: return False
  return True


def copy_out(t: Tensor) -> np.ndarray:
  """A realized tensor's contents on the host (waits for the device); tensors without a buffer of their own go through
  tinygrad's scheduler."""
  buf = t.uop.buffer if t.uop.has_buffer_identity() else None
  if buf is None or not buf.is_initialized(): return t.numpy()
  out = np.empty(t.shape, dtype=_to_np_dtype(t.dtype))
  buf.allocator._copyout(memoryview(out).cast("B"), buf._buf)
  return out


class CudaDownload:
  """Asynchronous copies of realized tensors into pinned host memory, on the stream the steps run on, with an event
  recorded after them: `result()` waits for the event, not for the whole device."""
  _HOST = BufferSpec(host=True)

  def __init__(self, device: str, tensors: tuple[Tensor, ...]):
    from tinygrad.runtime.autogen import cuda
    from tinygrad.runtime.ops_cuda import check as cuda_check
    self._cuda, self._check, self._dev = cuda, cuda_check, Device[device]
    cuda_check(cuda.cuCtxSetCurrent(self._dev.context))
    self._arrays = [np.empty(t.shape, dtype=_to_np_dtype(t.dtype)) for t in tensors]
    self._staging = []
    for t, out in zip(tensors, self._arrays, strict=True):
      buf = t.uop.buffer if t.uop.has_buffer_identity() else None
      if buf is None or not buf.is_initialized(): buf = t.contiguous().realize().uop.buffer
      host = self._dev.allocator.alloc(out.nbytes, self._HOST)
      cuda_check(cuda.cuMemcpyDtoHAsync_v2(host, buf._buf, out.nbytes, None))
      self._staging.append(host)
    self._event = cuda.CUevent()
    cuda_check(cuda.cuEventCreate(ctypes.byref(self._event), 0))
    cuda_check(cuda.cuEventRecord(self._event, None))
    self._copyins = list(self._dev.pending_copyin)   # staging copies complete when the event is (held: ids stay unique)
    self._done = False

  def result(self) -> list[np.ndarray]:
    if not self._done:
      cuda, cuda_check, dev = self._cuda, self._check, self._dev
      cuda_check(cuda.cuCtxSetCurrent(dev.context))
      cuda_check(cuda.cuEventSynchronize(self._event))
      cuda_check(cuda.cuEventDestroy_v2(self._event))
      for host, out in zip(self._staging, self._arrays, strict=True):
        ctypes.memmove(out.ctypes.data, host, out.nbytes)
        dev.allocator.free(host, out.nbytes, self._HOST)
      ours = {id(entry) for entry in self._copyins}
      done = [entry for entry in dev.pending_copyin if id(entry) in ours]
      dev.pending_copyin[:] = [entry for entry in dev.pending_copyin if id(entry) not in ours]
      for opaque, size, spec in done: dev.allocator.free(opaque, size, spec)
      self._copyins, self._done = [], True
    return self._arrays


# ---- TinyJit, memory counters

def capture_on_first_call(jit: TinyJit) -> TinyJit:
  """TinyJit's default plain first run would schedule and build the whole step a second time for every new layout;
  a step that has nothing to initialise can be captured at once."""
  jit.cnt = 1
  return jit


@dataclass
class PeakMemory:
  start: int
  peak: int

  @property
  def extra_bytes(self) -> int: return self.peak - self.start


@contextlib.contextmanager
def track_peak_memory() -> Iterator[PeakMemory]:
  """The highest GlobalCounters.mem_used (bytes of tinygrad buffers) reached while the block runs."""
  peak = PeakMemory(GlobalCounters.mem_used, GlobalCounters.mem_used)
  original = Buffer.allocate

  def allocate(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    peak.peak = max(peak.peak, GlobalCounters.mem_used)
    return out
  Buffer.allocate = allocate  # type: ignore[method-assign]
  try: yield peak
  finally: Buffer.allocate = original  # type: ignore[method-assign]
