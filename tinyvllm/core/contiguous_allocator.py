"""The contiguous KV cache's allocator: every running sequence owns one pre-allocated row of max_model_len slots.

It is the baseline the paged BlockManager is compared with: simple, but each sequence reserves its whole context up
front, so far fewer sequences fit in the same memory. To the model runner a row is one block of max_model_len tokens.
"""
from __future__ import annotations

from tinyvllm.core.sequence import Sequence


class ContiguousAllocator:
  def __init__(self, num_rows: int, row_len: int):
    self.num_blocks, self.block_size = num_rows, row_len
    self.free_rows = list(range(num_rows - 1, -1, -1))

  @property
  def num_free_blocks(self) -> int: return len(self.free_rows)

  @property
  def num_used_blocks(self) -> int: return self.num_blocks - len(self.free_rows)

  def can_allocate(self, seq: Sequence) -> bool: return bool(self.free_rows)

  def allocate(self, seq: Sequence) -> None:
    assert not seq.block_table, f"sequence {seq.seq_id} already holds a row"
    seq.block_table = [self.free_rows.pop()]

  def can_append(self, seq: Sequence, num_tokens: int = 1) -> bool:
    return seq.num_computed_tokens + num_tokens <= self.block_size

  def append_slots(self, seq: Sequence, num_tokens: int = 1) -> None:
    """Make room for the next num_tokens K/V entries; a row already holds the whole context."""
    assert self.can_append(seq, num_tokens), f"sequence {seq.seq_id} outgrew its row of {self.block_size} tokens"

  def free(self, seq: Sequence) -> None:
    self.free_rows.extend(reversed(seq.block_table))
    seq.block_table = []
