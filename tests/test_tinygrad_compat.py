"""The one module that uses tinygrad internals (tinyvllm/platform/tinygrad_compat.py): every internal it relies on is
present in the installed tinygrad, and each helper does its job on the CPU. A tinygrad upgrade that breaks one fails
here, loudly, and at engine start."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, dtypes

from tinyvllm.platform import tinygrad_compat as compat


def test_every_internal_is_present():
  compat.check("CPU")


def test_a_missing_internal_is_named(monkeypatch):
  class JitWithoutCount:
    def __init__(self, fxn): pass
  monkeypatch.setattr(compat, "TinyJit", JitWithoutCount)
  with pytest.raises(compat.CompatError, match=r"lacks TinyJit\.cnt, which tinyvllm uses \(it supports tinygrad==0\.14\.0\)"):
    compat.check("CPU")


def test_copies_in_and_out_of_a_buffer_without_the_scheduler():
  t = Tensor.zeros(6, dtype=dtypes.int32, device="CPU").contiguous().realize()
  compat.copy_in(t, np.arange(6, dtype=np.int32) * 7)
  assert compat.copy_out(t).tolist() == [0, 7, 14, 21, 28, 35] and t.numpy().tolist() == [0, 7, 14, 21, 28, 35]
  assert compat.copy_out(t + 1).tolist() == [1, 8, 15, 22, 29, 36]   # no buffer of its own: through the scheduler
  assert compat.has_buffer_identity(t) and not compat.has_buffer_identity(t + 1)
  compat.copy_in(t, np.array([-1, -2], dtype=np.int32), offset_bytes=12)   # a part, the rest as it was
  assert compat.copy_out(t).tolist() == [0, 7, 14, -1, -2, 35]
  with pytest.raises(ValueError, match="pass the buffer"): compat.copy_in(t, np.zeros(2, np.int32), offset_bytes=20)


def test_step_io_uploads_a_part_into_the_buffer_of_its_size():
  from tinyvllm.worker.host_io import StepIO
  io = StepIO("CPU")
  whole = io.upload(np.arange(5, dtype=np.int32))
  part = io.upload(np.array([9, 9], dtype=np.int32), size=5, offset=3)
  assert part is whole and compat.copy_out(whole).tolist() == [0, 1, 2, 9, 9]


def test_capture_on_first_call_replays_from_the_first_call():
  calls = []

  def step(x: Tensor) -> Tensor:
    calls.append(1)
    return (x * 2).realize()
  jit = compat.capture_on_first_call(TinyJit(step))
  x = Tensor.zeros(4, device="CPU").contiguous().realize()
  for value in (1.0, 2.0, 3.0):
    x.assign(Tensor.full((4,), value, device="CPU")).realize()
    assert jit(x).tolist() == [2 * value] * 4
  assert len(calls) == 1   # captured on the first call, replayed after (no plain first run)


def test_install_gives_each_thread_its_own_cache_connection():
  compat.install()
  compat.install()   # idempotent
  import tinygrad.helpers
  assert tinygrad.helpers.db_connection.per_thread
  connections = []
  worker = threading.Thread(target=lambda: connections.append(tinygrad.helpers.db_connection()))
  worker.start()
  worker.join()
  assert connections[0] is not tinygrad.helpers.db_connection()


def test_peak_memory_sees_a_temporary_buffer():
  with compat.track_peak_memory() as peak:
    (Tensor.ones(1 << 16, device="CPU").contiguous() + 1).realize()
  assert peak.extra_bytes >= 4 << 16


def test_default_device_and_arch():
  assert compat.set_default_device("CPU") == "CPU" and isinstance(compat.device_arch("CPU"), str)
  assert compat.cuda_memory("CPU") is None


def test_pinned_memory_goes_back_when_no_array_over_it_is_left(monkeypatch):
  """pinned_array's host memory returns to the device's allocator once the array and every view of it are gone (an
  engine's bitmask arrays outlive nothing). The CUDA allocator is stood in for: the CPU has no pinned memory."""
  import ctypes
  import gc

  class Allocator:
    def __init__(self): self.held, self.freed = [], []
    def alloc(self, nbytes, spec):
      self.held.append(ctypes.create_string_buffer(nbytes))
      return ctypes.c_void_p(ctypes.addressof(self.held[-1]))
    def free(self, host, nbytes, spec): self.freed.append((host.value, nbytes, spec.host))

  allocator = Allocator()
  monkeypatch.setattr(compat, "Device", {"CUDA": type("Dev", (), {"allocator": allocator})()})
  array = compat.pinned_array("CUDA", (4, 8))
  assert array.shape == (4, 8) and array.dtype == np.int32 and array.ctypes.data == ctypes.addressof(allocator.held[0])
  array[:] = 7
  view = array.reshape(-1)
  del array
  gc.collect()
  assert allocator.freed == [] and (view == 7).all()   # a view still reads it
  del view
  gc.collect()
  assert allocator.freed == [(ctypes.addressof(allocator.held[0]), 128, True)]
