"""The contiguous KV cache's allocator: every running sequence owns one pre-allocated row of max_model_len slots.

It is the baseline the paged BlockManager is compared with: simple, but each sequence reserves its whole context up
front, so far fewer sequences fit in the same memory. To the model runner a row is one block of max_model_len tokens.
Forked samples cannot share rows: a request with n samples reserves n rows when it starts, and a fork copies the
parent's row.
"""
from __future__ import annotations

from collections.abc import Iterable

from tinyvllm.core.sequence import Sequence


class ContiguousAllocator:
  def __init__(self, num_rows: int, row_len: int):
    self.num_blocks, self.block_size = num_rows, row_len
    self.free_rows = list(range(num_rows - 1, -1, -1))
    self.reserved: dict[int, list[int]] = {}   # parent seq id -> rows kept for its forks
    self.rows: dict[int, list[int]] = {}       # seq id -> [its row]

  @property
  def num_free_blocks(self) -> int: return len(self.free_rows)

  @property
  def num_used_blocks(self) -> int: return self.num_blocks - len(self.free_rows)

  def blocks_for(self, num_tokens: int) -> int: return 1

  def block_table(self, seq: Sequence) -> list[int]: return self.rows.get(seq.seq_id, [])

  def can_allocate(self, seq: Sequence, num_new_tokens: int, num_seqs: int = 1, releasing: Iterable[Sequence] = ()) -> bool:
    """Whether seq (and its forks) can have rows, once the `releasing` sequences (about to be preempted) gave theirs back."""
    freed = sum(len(self.rows.get(s.seq_id, [])) + len(self.reserved.get(s.seq_id, [])) for s in releasing)
    return len(self.free_rows) + freed >= num_seqs

  def allocate(self, seq: Sequence, num_seqs: int = 1) -> int:
    """Give seq a row (and rows for its forks); returns the tokens already computed (none: no prefix reuse here)."""
    assert seq.seq_id not in self.rows, f"sequence {seq.seq_id} already holds a row"
    self.rows[seq.seq_id] = [self.free_rows.pop()]
    if num_seqs > 1: self.reserved[seq.seq_id] = [self.free_rows.pop() for _ in range(num_seqs - 1)]
    return 0

  def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
    return seq.num_computed_tokens + num_new_tokens <= self.block_size

  def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
    """A row already holds the whole context: nothing to allocate, nothing to copy."""
    assert self.can_append(seq, num_new_tokens), f"sequence {seq.seq_id} outgrew its row of {self.block_size} tokens"
    return []

  def trim(self, seq: Sequence) -> None:
    """A row holds the whole context: rejected proposals' slots are simply written again."""

  def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
    self.rows[child.seq_id] = [self.reserved[parent.seq_id].pop()]
    return [(self.rows[parent.seq_id][0], self.rows[child.seq_id][0])]

  def register_computed(self, seq: Sequence) -> None:
    """No prefix cache in the contiguous baseline."""

  def free(self, seq: Sequence) -> None:
    self.free_rows.extend(reversed(self.rows.pop(seq.seq_id, []) + self.reserved.pop(seq.seq_id, [])))
