"""The portable backend: tinygrad tensor ops on every device (tinyvllm/layers/attention.py), the reference."""
from __future__ import annotations

from tinyvllm.layers.attention import paged_attention, write_kv
from tinyvllm.layers.linear import portable_linear


class PortableBackend:
  name = "portable"

  def __init__(self, reason: str = ""):
    self.reason = reason
    self.attention = paged_attention
    self.write_kv = write_kv
    self.linear = portable_linear

  def describe(self) -> str: return "portable (tinygrad ops)" + (f": {self.reason}" if self.reason else "")
