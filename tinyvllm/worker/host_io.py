"""The step's two host <-> device copies without tinygrad's scheduler: the packed int32 metadata into a persistent
device buffer, and the sampled ids (and logprobs) back out.

`Tensor(array).realize()` and `Tensor.numpy()` each build, schedule and run a small copy graph: ~1 ms of host time per
step that a decode step of ~1 ms on the GPU cannot hide. And a fresh input buffer every step makes the captured CUDA
graph re-point its kernels at it. Copying straight through the device's allocator into the same buffer (one per packed
size, so every replay of a capture sees the same input) avoids both. On CUDA the copy in is asynchronous on the
stream the graph runs on, from a pinned staging copy, so it is ordered before the step's kernels.

Like kernels/tinygrad_program.py this touches tinygrad internals (tinygrad==0.14.0 is pinned): `UOp.buffer`, a
Buffer's `_buf` and `allocator`, and the allocators' `_copyin` / `_copyout`.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.dtype import _to_np_dtype


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
