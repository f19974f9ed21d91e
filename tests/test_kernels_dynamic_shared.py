"""How a Launch's dynamic shared memory reaches tinygrad's CUDA program (tinyvllm/platform/tinygrad_compat.py), on the
CPU: tinygrad turns our PROGRAM into the ELF object its device's `runtime_t` is called with, and the wrapper must find
the recorded bytes from that object alone, per binary and kernel name."""
from __future__ import annotations

import inspect

import pytest
from tinygrad import Tensor
from tinygrad.device import Compiled
from tinygrad.uop.ops import UOp

from tinyvllm.kernels.plan import Launch, Param
from tinyvllm.platform import tinygrad_compat as compat
from tinyvllm.platform.tinygrad_compat import DynamicSharedRuntime, dynamic_shared_bytes


class Built:
  """Stands in for CUDAProgram (same constructor), keeping what it was built with."""

  def __init__(self, dev, obj, smem: int = 0): self.dev, self.obj, self.smem = dev, obj, smem


class FakeDevice:
  """Stands in for a tinygrad CUDA device: tinygrad's Compiled.runtime calls runtime_t(self, elf)."""
  runtime = Compiled.runtime

  def __init__(self): self.runtime_t = Built


def _elf(kernel: str, binary: bytes):
  """The object tinygrad's get_runtime hands the device for a kernel that run_kernel launches (Ops.PROGRAM.to_elf)."""
  launch = Launch(kernel, (1, 1, 1), 32, (Param("y", "float", True, 4),))
  fxn = compat.program(launch.kernel, launch.grid, launch.threads, (0,), (), "// source", binary, "CPU")
  return fxn(UOp.placeholder_like(Tensor.empty(4).uop, slot=0)).to_elf()


@pytest.fixture
def use_dynamic_shared(monkeypatch):
  """compat.use_dynamic_shared on a FakeDevice (named "FAKE") instead of a CUDA device; returns (use, device)."""
  dev = FakeDevice()

  def use(binary: bytes, kernel: str, nbytes: int) -> None:
    with monkeypatch.context() as m:
      m.setattr(compat, "Device", {"FAKE": dev})
      compat.use_dynamic_shared("FAKE", binary, kernel, nbytes)
  return use, dev


def test_programs_get_the_bytes_recorded_for_their_binary_and_kernel(use_dynamic_shared):
  use, _ = use_dynamic_shared
  runtime = DynamicSharedRuntime(Built)
  four_stages, two_stages = b"cubin of tv_gemm with 4 stages", b"cubin of tv_gemm with 2 stages"
  use(four_stages, "tv_gemm", 82432)
  use(two_stages, "tv_gemm", 41472)
  assert runtime("dev", _elf("tv_gemm", four_stages)).smem == 82432 == dynamic_shared_bytes(four_stages, "tv_gemm")
  assert runtime("dev", _elf("tv_gemm", two_stages)).smem == 41472   # same kernel name, other specialisation
  assert runtime("dev", _elf("tv_gemm_reduce", four_stages)).smem == 0   # another kernel of the same binary
  assert runtime("dev", _elf("tv_gemm", b"never recorded")).smem == 0
  use(two_stages, "tv_gemm", 1024)   # a smaller size never shrinks what a program launches with
  assert runtime("dev", _elf("tv_gemm", two_stages)).smem == 41472


def test_wrapping_a_device_once_keeps_its_programs_working(use_dynamic_shared):
  use, dev = use_dynamic_shared
  use(b"wrapped", "tv_gemm", 4096)
  use(b"wrapped too", "tv_gemm", 2048)
  assert isinstance(dev.runtime_t, DynamicSharedRuntime) and dev.runtime_t.program_class is Built
  prg = dev.runtime(_elf("tv_gemm", b"wrapped"))
  assert (prg.dev, prg.smem) == (dev, 4096)


def test_the_tinygrad_internals_the_wrapper_relies_on():
  """tinygrad 0.14: programs are built as runtime_t(device, elf); CUDAProgram takes `smem` (the attribute and the
  launch's bytes), and CUDA graph nodes launch with `runtime.smem`."""
  from tinygrad.engine import realize
  from tinygrad.runtime.graph import cuda as cuda_graph
  from tinygrad.runtime.ops_cuda import CUDAProgram
  assert "runtime_t" in inspect.getsource(Compiled.runtime)
  assert ".runtime(ast.to_elf())" in inspect.getsource(realize.get_runtime)
  assert "smem" in inspect.signature(CUDAProgram.__init__).parameters
  assert "MAX_DYNAMIC_SHARED_SIZE_BYTES" in inspect.getsource(CUDAProgram.__init__)
  assert "runtime.smem" in inspect.getsource(cuda_graph.CUDAGraph.__init__)
