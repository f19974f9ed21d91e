"""What attention needs to know about a step's batch, as int32 tensors (built by the model runner)."""
from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor


@dataclass
class AttentionMetadata:
  """N flat new tokens in S query rows, laid out as [S, Tq]. A row is one sequence's run of new tokens (Tq = the longest
  run, 1 for pure decode), or, for a backend that splits query runs (splits_query_runs) and for a small verification of
  proposals laid out as decode rows (decode_verify_tokens), a piece of one: rows of one sequence share its block table."""
  slot_mapping: Tensor   # [N] int32: cache slot (block * block_size + offset) each new token's K/V goes to; -1 = skip
  block_tables: Tensor   # [S, max_blocks] int32: physical block of each logical block of the row's sequence (padding: any valid block)
  query_index: Tensor    # [S, Tq] int32: flat token index of each padded query (padding: any valid index)
  query_pos: Tensor      # [S, Tq] int32: position of each padded query in its sequence
  output_index: Tensor   # [N] int32: where each flat token's output sits in the [S * Tq] padded layout
  context_lens: Tensor   # [S] int32: keys visible to each row's last new token (0 for padding rows)
  query_start: Tensor    # [S + 1] int32: flat offset of each row's first new token
  new_keys: Tensor       # [S] int32: keys of each row's context this step computes, up to its last query (its sequence's
                         # new tokens so far: a decode row's 1; 0 for padding rows)
  row_order: Tensor      # [S] int32: the rows by descending context_lens (padding rows last): the order in which the
                         # kernels start their blocks, so that the longest rows' blocks do not start last and leave the
                         # GPU waiting on a few of them
  block_size: int
  context_len: int       # L: keys gathered per sequence, a multiple of block_size

  @property
  def is_decode(self) -> bool:
    """Every sequence has one new token (Tq == 1)."""
    return self.query_index.shape[1] == 1
