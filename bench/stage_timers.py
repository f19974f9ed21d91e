"""Timers on named stages of the engine, for the benchmarks that ask where host time goes (bench/serve_profile.py,
bench/structured_bench.py): methods wrapped on classes or instances, put back by `restore`."""
from __future__ import annotations

import inspect
import threading
import time
from collections import defaultdict


class Timers:
  """Seconds and calls per named stage, from any thread."""

  def __init__(self) -> None:
    self.seconds: dict[str, float] = defaultdict(float)
    self.calls: dict[str, int] = defaultdict(int)
    self.lock = threading.Lock()
    self._undo: list = []

  def add(self, name: str, seconds: float) -> None:
    with self.lock:
      self.seconds[name] += seconds
      self.calls[name] += 1

  def wrap(self, owner: object, attr: str, name: str) -> None:
    original, static = getattr(owner, attr), inspect.getattr_static(owner, attr)

    def timed(*args, **kwargs):
      t = time.perf_counter()
      try: return original(*args, **kwargs)
      finally: self.add(name, time.perf_counter() - t)
    setattr(owner, attr, staticmethod(timed) if isinstance(static, staticmethod) else timed)
    # a class gets its attribute back; an instance's wrapper is deleted, which uncovers its class's method again
    self._undo.append((lambda: setattr(owner, attr, static)) if isinstance(owner, type) else (lambda: delattr(owner, attr)))

  def restore(self) -> None:
    """Put every wrapped method back."""
    while self._undo: self._undo.pop()()

  def report(self) -> dict:
    return {name: {"s": round(s, 4), "calls": self.calls[name], "ms_per_call": round(1e3 * s / max(self.calls[name], 1), 4)}
            for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
