"""The step's two host <-> device copies without tinygrad's scheduler: the packed int32 metadata into a persistent
device buffer, and the sampled ids (and logprobs) back out.

On CUDA the copy out can be asynchronous too (`download_later`): enqueued behind the step's kernels into pinned memory,
with an event to wait on, so the host can launch the next step before this one's tokens are read (asynchronous
scheduling). Everywhere else `download_later` copies at once.

`Tensor(array).realize()` and `Tensor.numpy()` each build, schedule and run a small copy graph: ~1 ms of host time per
step that a decode step of ~1 ms on the GPU cannot hide. And a fresh input buffer every step makes the captured CUDA
graph re-point its kernels at it. Copying straight through the device's allocator into the same buffer (one per packed
size, so every replay of a capture sees the same input) avoids both (the copies themselves:
tinyvllm/platform/tinygrad_compat.py). On CUDA the copy in is asynchronous on the stream the graph runs on, from a
pinned staging copy, so it is ordered before the step's kernels. Data filled on the host each step in bulk (the
structured-output bitmask: 1.2 MB at batch 64 on Qwen3's vocabulary) can be filled straight into pinned memory
(`host_array`), which the copy reads without that staging copy.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

from tinyvllm.platform import tinygrad_compat as compat


def reads_back_asynchronously(device: str) -> bool:
  """Whether `download_later` can return before the device has finished (CUDA: pinned memory and an event)."""
  return device.split(":")[0] == "CUDA"


class StepIO:
  def __init__(self, device: str):
    self.device = device
    self._inputs: dict[int, Tensor] = {}
    self._pinned: set[int] = set()   # the addresses of host_array's pinned arrays

  def host_array(self, shape: tuple[int, ...]) -> np.ndarray:
    """An int32 host array for `upload` to take whole: on CUDA in pinned memory, copied from directly (no staging copy
    on the host; it must then stay as it is until the step that reads it has finished), elsewhere a plain array."""
    if not reads_back_asynchronously(self.device): return np.empty(shape, np.int32)
    array = compat.pinned_array(self.device, shape, np.int32)
    self._pinned.add(array.ctypes.data)
    return array

  def upload(self, packed: np.ndarray, size: int | None = None, offset: int = 0) -> Tensor:
    """The device tensor of `size` int32s (default: packed's) holding `packed` from `offset` on: the same tensor every
    time for a given size (a part uploaded leaves the rest as it was)."""
    packed = np.ascontiguousarray(packed, dtype=np.int32)
    size = packed.size if size is None else size
    t = self._inputs.get(size)
    if t is None: t = self._inputs[size] = Tensor.zeros(size, dtype=dtypes.int32, device=self.device).contiguous().realize()
    if packed.ctypes.data in self._pinned: compat.copy_in_pinned(t, packed, offset * 4)
    else: compat.copy_in(t, packed, offset * 4)
    return t

  def download(self, t: Tensor) -> np.ndarray:
    """A realized tensor's contents on the host (waits for the device)."""
    return compat.copy_out(t)

  def download_later(self, tensors: tuple[Tensor, ...]) -> Download:
    """Copies of realized tensors' contents, ready once the device has finished the work enqueued so far."""
    if reads_back_asynchronously(self.device): return compat.CudaDownload(self.device, tensors)
    return Download([self.download(t) for t in tensors])


class Download:
  def __init__(self, arrays: list[np.ndarray]): self._arrays = arrays

  def result(self) -> list[np.ndarray]: return self._arrays
