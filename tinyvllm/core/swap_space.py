"""SwapSpace: the bookkeeping of the host-memory block pool that swapped-out sequences keep their KV blocks in
(`--preemption-mode swap`, sized by `--swap-space` GiB). Plain Python; the blocks' bytes are the KV cache's
(worker/kv_cache.py), copied by the model runner before the step that the scheduler decided them in.

Each swapped-out sequence holds its own host blocks, one per device block it held (a block shared with other
sequences stays on the device for them, and this sequence keeps its own copy here). Blocks freed by a swap-in are
handed out again only from the next step on: the runner does a step's swap-outs before its swap-ins, so a block
reused in the same step would be overwritten before it is read.
"""
from __future__ import annotations


class SwapSpace:
  def __init__(self, num_blocks: int):
    self.num_blocks = num_blocks
    self.free_blocks = list(range(num_blocks - 1, -1, -1))   # pop() hands out the lowest first
    self.tables: dict[int, list[int]] = {}                    # seq id -> its host blocks, in its table's order
    self.released: list[int] = []                             # freed by this step's swap-ins (free from the next)

  @property
  def num_free_blocks(self) -> int: return len(self.free_blocks)

  @property
  def num_used_blocks(self) -> int: return self.num_blocks - len(self.free_blocks)

  def can_hold(self, num_blocks: int) -> bool: return num_blocks <= len(self.free_blocks)

  def take(self, seq_id: int, num_blocks: int) -> list[int]:
    assert seq_id not in self.tables and self.can_hold(num_blocks), f"no swap space for sequence {seq_id}"
    table = self.tables[seq_id] = [self.free_blocks.pop() for _ in range(num_blocks)]
    return table

  def table(self, seq_id: int) -> list[int]: return self.tables.get(seq_id, [])

  def swap_in(self, seq_id: int) -> list[int]:
    """The sequence's host blocks (their contents are copied back this step); free from the next step on."""
    table = self.tables.pop(seq_id)
    self.released += table
    return table

  def free(self, seq_id: int) -> None:
    """Forget a sequence that ended while swapped out (its blocks hold nothing anyone reads)."""
    self.free_blocks.extend(reversed(self.tables.pop(seq_id, [])))

  def end_step(self) -> None:
    self.free_blocks.extend(reversed(self.released))
    self.released = []
