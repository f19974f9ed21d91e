"""Host-side step inputs: one scheduled batch flattened into named int32 arrays, padded to bucket sizes.

Padding keeps the number of distinct shapes (hence compiled kernels and JIT captures) small: N tokens, S sequences,
the query run Tq and the context length L are each rounded up to a power of two. Padding tokens write nowhere
(slot -1); padding sequences have context length 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.core.scheduler_output import ScheduledSequence
from tinyvllm.core.sequence import Sequence


def bucket(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return 1 << (max(n, minimum) - 1).bit_length()


@dataclass
class HostBatch:
  arrays: dict[str, np.ndarray]   # the step metadata, all int32 (see prepare_batch for each one's meaning)
  context_len: int                # L: keys gathered per sequence by the portable attention
  sample_seqs: list[Sequence]     # the sequence each sampling row is for (forks share their parent's logits row)

  def __getattr__(self, name: str) -> np.ndarray:
    try: return self.__dict__["arrays"][name]
    except KeyError: raise AttributeError(name) from None


def slots_for(block_table: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
  table = np.asarray(block_table, dtype=np.int64)
  return (table[positions // block_size] * block_size + positions % block_size).astype(np.int32)


def _empty(n: int, s: int, tq: int, max_blocks: int) -> dict[str, np.ndarray]:
  z = lambda *shape: np.zeros(shape, np.int32)
  return {
    "token_ids": z(n), "positions": z(n),
    "slot_mapping": np.full(n, -1, np.int32),   # cache slot each new token's K/V goes to (-1: padding, not written)
    "output_index": z(n),                       # where each flat token's output sits in the [S * Tq] padded layout
    "block_tables": z(s, max_blocks),           # physical block of each logical block
    "query_index": z(s, tq), "query_pos": z(s, tq),   # flat index and position of each padded query
    "context_lens": z(s),                       # keys visible to each sequence's last query (0: padding)
    "query_start": z(s + 1),                    # flat offset of each sequence's first new token (exclusive scan)
  }


def prepare_batch(scheduled: list[ScheduledSequence], block_size: int) -> HostBatch:
  n_real = sum(s.num_new_tokens for s in scheduled)
  n, s_pad = bucket(n_real), bucket(len(scheduled))
  tq = bucket(max(s.num_new_tokens for s in scheduled))
  longest = max(s.seq.num_computed_tokens + s.num_new_tokens for s in scheduled)
  context_len = bucket(longest, 16)
  max_blocks = -(-context_len // block_size)
  a = _empty(n, s_pad, tq, max_blocks)
  logits_index, sample_seqs, start = [], [], 0
  for row, item in enumerate(scheduled):
    seq, count = item.seq, item.num_new_tokens
    pos = np.arange(seq.num_computed_tokens, seq.num_computed_tokens + count, dtype=np.int32)
    flat = slice(start, start + count)
    a["token_ids"][flat] = seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + count]
    a["positions"][flat], a["slot_mapping"][flat] = pos, slots_for(seq.block_table, pos, block_size)
    a["output_index"][flat] = row * tq + np.arange(count)
    table = seq.block_table[:max_blocks]
    a["block_tables"][row, :len(table)] = table
    a["query_index"][row, :count], a["query_pos"][row, :count] = np.arange(start, start + count), pos
    a["context_lens"][row] = seq.num_computed_tokens + count
    if item.samples:
      for target in (seq, *item.forks):
        logits_index.append(start + count - 1)
        sample_seqs.append(target)
    start += count
    a["query_start"][row + 1:] = start
  a["logits_index"] = np.zeros(bucket(len(logits_index)), np.int32)
  a["logits_index"][:len(logits_index)] = logits_index
  return HostBatch(a, context_len, sample_seqs)
