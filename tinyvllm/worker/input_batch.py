"""Host-side step inputs: one scheduled batch flattened into int32 arrays, padded to bucket sizes.

Padding keeps the number of distinct shapes (hence compiled kernels and JIT captures) small: N tokens, S sequences,
the query run Tq and the context length L are each rounded up to a power of two.
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
  token_ids: np.ndarray      # [N] int32
  positions: np.ndarray      # [N] int32
  slot_mapping: np.ndarray   # [N] int32, -1 for padding
  block_tables: np.ndarray   # [S, max_blocks] int32
  query_index: np.ndarray    # [S, Tq] int32
  query_pos: np.ndarray      # [S, Tq] int32
  output_index: np.ndarray   # [N] int32
  logits_index: np.ndarray   # [R] int32: flat token of each sampling row
  context_len: int           # L
  sample_seqs: list[Sequence]  # the sequence each sampling row is for (forks share their parent's logits row)


def slots_for(block_table: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
  table = np.asarray(block_table, dtype=np.int64)
  return (table[positions // block_size] * block_size + positions % block_size).astype(np.int32)


def prepare_batch(scheduled: list[ScheduledSequence], block_size: int) -> HostBatch:
  n_real = sum(s.num_new_tokens for s in scheduled)
  n, s_pad = bucket(n_real), bucket(len(scheduled))
  tq = bucket(max(s.num_new_tokens for s in scheduled))
  longest = max(s.seq.num_computed_tokens + s.num_new_tokens for s in scheduled)
  context_len = bucket(longest, 16)
  max_blocks = -(-context_len // block_size)

  token_ids, positions = np.zeros(n, np.int32), np.zeros(n, np.int32)
  slot_mapping, output_index = np.full(n, -1, np.int32), np.zeros(n, np.int32)
  block_tables = np.zeros((s_pad, max_blocks), np.int32)
  query_index, query_pos = np.zeros((s_pad, tq), np.int32), np.zeros((s_pad, tq), np.int32)
  logits_index, sample_seqs, start = [], [], 0
  for row, item in enumerate(scheduled):
    seq, count = item.seq, item.num_new_tokens
    pos = np.arange(seq.num_computed_tokens, seq.num_computed_tokens + count, dtype=np.int32)
    flat = slice(start, start + count)
    token_ids[flat] = seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + count]
    positions[flat], slot_mapping[flat] = pos, slots_for(seq.block_table, pos, block_size)
    output_index[flat] = row * tq + np.arange(count)
    table = seq.block_table[:max_blocks]
    block_tables[row, :len(table)] = table
    query_index[row, :count], query_pos[row, :count] = np.arange(start, start + count), pos
    if item.samples:
      for target in (seq, *item.forks):
        logits_index.append(start + count - 1)
        sample_seqs.append(target)
    start += count
  logits = np.zeros(bucket(len(logits_index)), np.int32)
  logits[:len(logits_index)] = logits_index
  return HostBatch(token_ids, positions, slot_mapping, block_tables, query_index, query_pos, output_index, logits,
                   context_len, sample_seqs)
