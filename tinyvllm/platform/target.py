"""The device facts the hand-written kernels depend on, read once when the backend is chosen.

Plans (tinyvllm/kernels/plan.py and its neighbours) are pure functions of a static shape, a DeviceTarget and the
tuning table, so the same plan can be built for the GPU, for the CPU emulator (a nominal target) and in tests.
"""
from __future__ import annotations

from dataclasses import dataclass

KILO = 1024


def native_dialect(device: str) -> str | None:
  """The kernel dialect for a tinygrad device name (CUDA, CUDA:PTX, METAL, ...), None where there is none."""
  return {"CUDA": "cuda", "METAL": "metal"}.get(device.split(":")[0].upper())


@dataclass(frozen=True)
class DeviceTarget:
  device: str                      # the tinygrad device name
  dialect: str | None              # "cuda" | "metal" | None: no hand-written kernels
  arch: str = ""                   # CUDA: "sm_90", ...
  multiprocessors: int = 0         # CUDA: SMs (the grid of a kernel whose blocks must all be resident at once)
  static_shared_bytes: int = 0     # static shared / threadgroup memory a block may use
  max_shared_bytes: int = 0        # static + dynamic shared memory a block may opt into (CUDA)
  sm_shared_bytes: int = 0         # shared memory of one SM (CUDA: blocks resident together share it)
  sm_registers: int = 0            # 32-bit registers of one SM (CUDA)

  @property
  def sm_version(self) -> int:
    """The CUDA compute capability as 10 * major + minor (sm_90 -> 90), 0 elsewhere."""
    digits = self.arch.removeprefix("sm_").rstrip("a")
    return int(digits) if self.dialect == "cuda" and digits.isdigit() else 0

  @property
  def tensor_cores(self) -> bool:
    """mma.sync on 16-bit operands with float32 accumulators (and cp.async): CUDA sm_80 and newer."""
    return self.sm_version >= 80

  @property
  def wgmma(self) -> bool:
    """Hopper's warpgroup MMA and bulk (TMA) copies: sm_90, compiled for its architecture-specific target sm_90a."""
    return self.sm_version == 90

  @property
  def grid_sync(self) -> bool:
    """A persistent kernel may spin on a grid barrier: every block resident at once (CUDA, grid = SM count); Metal
    gives no forward-progress guarantee across threadgroups."""
    return self.dialect == "cuda" and self.multiprocessors > 0

  @property
  def cuda_target(self) -> str:
    """The NVRTC target: a cubin for exactly this GPU (PTX from a newer NVRTC than the driver knows would not load);
    Hopper's architecture-specific sm_90a, which wgmma needs."""
    return self.arch + "a" if self.wgmma else self.arch

  @property
  def kind(self) -> str:
    """The key of the device's tuning table (tinyvllm/kernels/tuning/<kind>.json): the CUDA architecture, else the
    dialect."""
    return self.arch if self.dialect == "cuda" and self.arch else (self.dialect or "none")

  @classmethod
  def nominal(cls, dialect: str, arch: str = "sm_90", multiprocessors: int = 132) -> DeviceTarget:
    """The target of a typical device of the dialect (an H100 for CUDA, an Apple GPU for Metal): for plans built
    without the device, e.g. for the CPU emulator."""
    if dialect == "metal": return cls("METAL", "metal", static_shared_bytes=32 * KILO, max_shared_bytes=32 * KILO)
    if dialect != "cuda": raise ValueError(f"unknown kernel dialect {dialect!r}")
    return cls("CUDA", "cuda", arch, multiprocessors, 48 * KILO, 227 * KILO, 228 * KILO, 65536)


def detect_target(device: str) -> DeviceTarget:
  """The target of a device tinygrad has opened."""
  dialect = native_dialect(device)
  if dialect == "metal": return DeviceTarget(device, "metal", static_shared_bytes=32 * KILO, max_shared_bytes=32 * KILO)
  if dialect != "cuda": return DeviceTarget(device, None)
  from tinyvllm.platform import tinygrad_compat as compat
  attribute = lambda name: compat.cuda_attribute(device, name)
  return DeviceTarget(device, "cuda", compat.device_arch(device), attribute("MULTIPROCESSOR_COUNT"),
                      attribute("MAX_SHARED_MEMORY_PER_BLOCK"), attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
                      attribute("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"), attribute("MAX_REGISTERS_PER_MULTIPROCESSOR"))
