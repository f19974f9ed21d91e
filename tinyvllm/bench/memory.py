"""Peak device memory held by tinygrad buffers over a region of code (tinygrad counts the current total only)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from tinygrad.device import Buffer
from tinygrad.helpers import GlobalCounters


@dataclass
class Peak:
  start: int
  peak: int

  @property
  def extra_bytes(self) -> int: return self.peak - self.start


@contextlib.contextmanager
def track_peak_memory() -> Iterator[Peak]:
  """Records the highest GlobalCounters.mem_used reached while the block runs (weights and caches included)."""
  peak = Peak(GlobalCounters.mem_used, GlobalCounters.mem_used)
  original = Buffer.allocate

  def allocate(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    peak.peak = max(peak.peak, GlobalCounters.mem_used)
    return out
  Buffer.allocate = allocate  # type: ignore[method-assign]
  try: yield peak
  finally: Buffer.allocate = original  # type: ignore[method-assign]
