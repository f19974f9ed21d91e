"""The step's two host <-> device copies without tinygrad's scheduler: the packed int32 metadata into a persistent
device buffer, and the sampled ids (and logprobs) back out.

On CUDA the copy out can be asynchronous too (`download_later`): enqueued behind the step's kernels into pinned memory,
with an event to wait on, so the host can launch the next step before this one's tokens are read (asynchronous
scheduling). Everywhere else `download_later` copies at once.

`Tensor(array).realize()` and `Tensor.numpy()` each build, schedule and run a small copy graph: ~1 ms of host time per
step that a decode step of ~1 ms on the GPU cannot hide. And a fresh input buffer every step makes the captured CUDA
graph re-point its kernels at it. Copying straight through the device's allocator into the same buffer (one per packed
size, so every replay of a capture sees the same input) avoids both. On CUDA the copy in is asynchronous on the
stream the graph runs on, from a pinned staging copy, so it is ordered before the step's kernels.

Like kernels/tinygrad_program.py this touches tinygrad internals (tinygrad==0.14.0 is pinned): `UOp.buffer`, a
Buffer's `_buf` and `allocator`, the allocators' `_copyin` / `_copyout`, and on CUDA the device's context and its list
of pinned staging copies (`pending_copyin`, which tinygrad frees only on a full synchronize).
"""
from __future__ import annotations

import ctypes

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.device import BufferSpec
from tinygrad.dtype import _to_np_dtype


def reads_back_asynchronously(device: str) -> bool:
  """Whether `download_later` can return before the device has finished (CUDA: pinned memory and an event)."""
  return device.split(":")[0] == "CUDA"


class StepIO:
  def __init__(self, device: str):
    self.device = device
    self._inputs: dict[int, Tensor] = {}

  def upload(self, packed: np.ndarray) -> Tensor:
    """The device tensor holding `packed` (int32): the same tensor every time for a given size."""
    packed = np.ascontiguousarray(packed, dtype=np.int32)
    t = self._inputs.get(packed.size)
    if t is None: t = self._inputs[packed.size] = Tensor.zeros(packed.size, dtype=dtypes.int32, device=self.device).contiguous().realize()
    buf = t.uop.buffer.ensure_allocated()
    Device[self.device].allocator._copyin(buf._buf, memoryview(packed).cast("B"))
    return t

  def download(self, t: Tensor) -> np.ndarray:
    """A realized tensor's contents on the host (waits for the device)."""
    buf = t.uop.buffer if t.uop.has_buffer_identity() else None
    if buf is None or not buf.is_initialized(): return t.numpy()
    out = np.empty(t.shape, dtype=_to_np_dtype(t.dtype))
    buf.allocator._copyout(memoryview(out).cast("B"), buf._buf)
    return out

  def download_later(self, tensors: tuple[Tensor, ...]) -> Download:
    """Copies of realized tensors' contents, ready once the device has finished the work enqueued so far."""
    if reads_back_asynchronously(self.device): return CudaDownload(self.device, tensors)
    return Download([self.download(t) for t in tensors])


class Download:
  def __init__(self, arrays: list[np.ndarray]): self._arrays = arrays

  def result(self) -> list[np.ndarray]: return self._arrays


class CudaDownload(Download):
  """Asynchronous copies into pinned memory on the stream the steps run on, and an event recorded after them."""
  _HOST = BufferSpec(host=True)

  def __init__(self, device: str, tensors: tuple[Tensor, ...]):
    from tinygrad.runtime.autogen import cuda
    from tinygrad.runtime.ops_cuda import check
    self._cuda, self._check, self._dev = cuda, check, Device[device]
    check(cuda.cuCtxSetCurrent(self._dev.context))
    super().__init__([np.empty(t.shape, dtype=_to_np_dtype(t.dtype)) for t in tensors])
    self._staging = []
    for t, out in zip(tensors, self._arrays, strict=True):
      buf = t.uop.buffer if t.uop.has_buffer_identity() else None
      if buf is None or not buf.is_initialized(): buf = t.contiguous().realize().uop.buffer
      host = self._dev.allocator.alloc(out.nbytes, self._HOST)
      check(cuda.cuMemcpyDtoHAsync_v2(host, buf._buf, out.nbytes, None))
      self._staging.append(host)
    self._event = cuda.CUevent()
    check(cuda.cuEventCreate(ctypes.byref(self._event), 0))
    check(cuda.cuEventRecord(self._event, None))
    self._copyins = list(self._dev.pending_copyin)   # staging copies complete when the event is (held: ids stay unique)
    self._done = False

  def result(self) -> list[np.ndarray]:
    if not self._done:
      cuda, check, dev = self._cuda, self._check, self._dev
      check(cuda.cuCtxSetCurrent(dev.context))
      check(cuda.cuEventSynchronize(self._event))
      check(cuda.cuEventDestroy_v2(self._event))
      for host, out in zip(self._staging, self._arrays, strict=True):
        ctypes.memmove(out.ctypes.data, host, out.nbytes)
        dev.allocator.free(host, out.nbytes, self._HOST)
      ours = {id(entry) for entry in self._copyins}
      done = [entry for entry in dev.pending_copyin if id(entry) in ours]
      dev.pending_copyin[:] = [entry for entry in dev.pending_copyin if id(entry) not in ours]
      for opaque, size, spec in done: dev.allocator.free(opaque, size, spec)
      self._copyins = []
      self._done = True
    return self._arrays
