"""prepare_batch (vectorised) against a per-sequence reading of what each field means."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tinyvllm.core.scheduler_output import ScheduledSequence
from tinyvllm.core.sequence import Sequence
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import COARSE_QUERY_RUNS, StepBuckets, bucket, prepare_batch

BLOCK = 4


def random_batch(rng: random.Random) -> list[ScheduledSequence]:
  items, next_block = [], 0
  for _ in range(rng.randint(1, 9)):
    prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 23))]
    seq = Sequence("r", prompt, SamplingParams(), seed=0, output_token_ids=[rng.randrange(1000) for _ in range(rng.choice((0, 0, 3, 9)))])
    start = rng.randrange(seq.num_tokens)          # what is cached already
    new = rng.randint(1, seq.num_tokens - start)   # a chunk, the rest, or one decode token
    blocks = -(-(start + new) // BLOCK)
    table = rng.sample(range(next_block, next_block + 3 * blocks), blocks)   # scattered, with holes
    next_block += 3 * blocks
    samples = start + new == seq.num_tokens
    forks = (Sequence("r", prompt, SamplingParams(), seed=1),) if samples and rng.random() < 0.3 else ()
    items.append(ScheduledSequence(seq, start, new, table, samples, forks, sample_index=len(seq.output_token_ids)))
  return items


@pytest.mark.parametrize("seed", range(40))
def test_fields_match_their_per_sequence_meaning(seed: int) -> None:
  items = random_batch(random.Random(seed))
  min_rows, coarse = 16 if seed % 3 == 0 else 1, seed % 4 == 1   # coarse: the fused kernels' prompt-step buckets
  buckets = StepBuckets(16 if seed % 2 else 64, min_rows, min_prompt_tokens=32 if coarse else 1, coarse_query_runs=coarse)
  host = prepare_batch(items, BLOCK, buckets)
  a = host.arrays
  tq, longest, n_real = a["query_index"].shape[1], max(i.num_new_tokens for i in items), sum(i.num_new_tokens for i in items)
  assert a["token_ids"].shape == (bucket(n_real, 32 if coarse and longest > 1 else 1),)
  if coarse and longest > 1: assert tq == min(next(c for c in COARSE_QUERY_RUNS if c >= longest), a["token_ids"].shape[0])
  else: assert tq == bucket(longest)
  floor = min_rows if tq > 1 else 1   # only steps with prompt chunks are padded to the row floor
  assert a["context_lens"].shape == (bucket(len(items), floor),)
  assert a["logits_index"].shape == (bucket(sum(1 + len(i.forks) for i in items if i.samples), floor),)
  assert host.context_len == bucket(max(i.start + i.num_new_tokens for i in items), 16 if seed % 2 else 64)
  flat, rows_sampled = 0, []
  for row, item in enumerate(items):
    seq, c, n, table = item.seq, item.start, item.num_new_tokens, item.block_table
    span = slice(flat, flat + n)
    assert a["token_ids"][span].tolist() == seq.token_ids[c:c + n]
    assert a["positions"][span].tolist() == list(range(c, c + n))
    assert a["slot_mapping"][span].tolist() == [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + n)]
    assert a["output_index"][span].tolist() == [row * tq + j for j in range(n)]
    assert a["query_index"][row, :n].tolist() == list(range(flat, flat + n))
    assert a["query_pos"][row, :n].tolist() == list(range(c, c + n))
    assert a["context_lens"][row] == c + n and a["query_start"][row] == flat and a["new_keys"][row] == n
    width = min(len(table), a["block_tables"].shape[1])
    assert a["block_tables"][row, :width].tolist() == table[:width]
    flat += n
    if item.samples: rows_sampled += [(flat - 1, s) for s in (seq, *item.forks)]
  assert (a["slot_mapping"][flat:] == -1).all() and (a["context_lens"][len(items):] == 0).all()
  assert (a["query_start"][len(items):] == flat).all()
  ctx = a["context_lens"].tolist()   # attention's launch order: the longest rows first, ties and padding in row order
  assert a["row_order"].tolist() == sorted(range(len(ctx)), key=lambda r: (-ctx[r], r))
  assert a["logits_index"][:len(rows_sampled)].tolist() == [i for i, _ in rows_sampled]
  assert host.sample_seqs == [s for _, s in rows_sampled]
  assert host.sample_steps == [len(s.output_token_ids) for _, s in rows_sampled]
  assert all(x.dtype == np.int32 for x in a.values())



@pytest.mark.parametrize("seed", range(40))
def test_split_runs_give_each_row_a_piece_of_one_sequence(seed: int) -> None:
  """split_runs (the portable backend): each sequence's run is cut into rows of Tq queries, Tq the power of two that
  needs the fewest padded query slots; every row means what a sequence's row means, for its piece of the run."""
  items = random_batch(random.Random(seed))
  a = prepare_batch(items, BLOCK, StepBuckets(16, split_runs=True)).arrays
  tq = a["query_index"].shape[1]
  counts = [i.num_new_tokens for i in items]
  slots = lambda t: bucket(sum(-(-c // t) for c in counts)) * t
  assert (slots(tq), -tq) == min((slots(t), -t) for t in (1 << i for i in range(bucket(max(counts)).bit_length())))
  assert a["query_index"].size == slots(tq) <= bucket(len(items)) * bucket(max(counts))
  flat, row = 0, 0
  for item in items:
    c, n, table = item.start, item.num_new_tokens, item.block_table
    assert a["slot_mapping"][flat:flat + n].tolist() == [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + n)]
    for first in range(0, n, tq):
      k, span = min(tq, n - first), slice(flat + first, flat + first + min(tq, n - first))
      assert a["query_index"][row, :k].tolist() == list(range(span.start, span.stop))
      assert a["query_pos"][row, :k].tolist() == list(range(c + first, c + first + k))
      assert a["output_index"][span].tolist() == [row * tq + j for j in range(k)]
      assert a["context_lens"][row] == c + first + k and a["query_start"][row] == span.start
      assert a["new_keys"][row] == first + k   # the sequence's new tokens up to the row's last query
      width = min(len(table), a["block_tables"].shape[1])
      assert a["block_tables"][row, :width].tolist() == table[:width]
      row += 1
    flat += n
  assert (a["context_lens"][row:] == 0).all() and (a["query_start"][row:] == flat).all()
  ctx = a["context_lens"].tolist()   # the rows (pieces of runs) in attention's launch order
  assert a["row_order"].tolist() == sorted(range(len(ctx)), key=lambda r: (-ctx[r], r))


def test_split_runs_put_decodes_beside_a_prompt_chunk_in_short_rows() -> None:
  """One 64-token chunk and seven decodes: 16 rows of 8 queries (128 slots), not 8 rows of 64 (512)."""
  seqs = [Sequence("r", list(range(64)), SamplingParams(), seed=0)] + [Sequence("r", [1, 2], SamplingParams(), seed=0)] * 7
  items = [ScheduledSequence(seqs[0], 0, 64, list(range(16)), True)] + [ScheduledSequence(s, 1, 1, [16], True) for s in seqs[1:]]
  assert prepare_batch(items, BLOCK, StepBuckets(split_runs=True)).arrays["query_index"].shape == (16, 8)
  assert prepare_batch(items, BLOCK).arrays["query_index"].shape == (8, 64)

def verifying(proposals: list[int], start: int = 9) -> list[ScheduledSequence]:
  """A decoding sequence per entry, its last token and that many proposals scheduled."""
  items = []
  for i, k in enumerate(proposals):
    seq = Sequence("r", list(range(start)), SamplingParams(), seed=0, output_token_ids=[7])
    table = [10 * i + b for b in range(-(-(start + 1 + k) // BLOCK))]
    items.append(ScheduledSequence(seq, start, 1 + k, table, True, spec_token_ids=tuple(range(100, 100 + k))))
  return items


def test_a_small_verification_is_laid_out_as_decode_rows() -> None:
  """Up to decode_verify_tokens tokens (the fused backend's layer kernel takes them), a verification's tokens are decode
  rows, unpadded: a row a token with its sequence's block table, context up to itself, new_keys counting its sequence's new
  tokens so far; the same flat tokens, slots and logits rows as the multi-query layout. Larger ones keep a row a
  sequence, as do steps with prompt chunks."""
  items = verifying([4, 2])
  rows, multi = (prepare_batch(items, BLOCK, StepBuckets(16, decode_verify_tokens=v), num_speculative_tokens=4).arrays
                 for v in (8, 0))
  assert rows["query_index"].shape == (8, 1) and multi["query_index"].shape == (2, 8)
  for name in ("token_ids", "positions", "slot_mapping", "logits_index", "draft_tokens"):
    np.testing.assert_array_equal(rows[name], multi[name], err_msg=name)
  # no padding rows: 5 tokens, 5 rows (the multi-query layout pads the tokens to 8)
  five = prepare_batch(verifying([4]), BLOCK, StepBuckets(16, decode_verify_tokens=8), num_speculative_tokens=4).arrays
  assert five["query_index"].shape == (5, 1) and five["token_ids"].shape == (5,) and five["new_keys"].tolist() == [1, 2, 3, 4, 5]
  assert five["query_start"].tolist() == list(range(6)) and five["context_lens"].tolist() == [10, 11, 12, 13, 14]
  assert rows["context_lens"].tolist() == [10, 11, 12, 13, 14, 10, 11, 12] and rows["new_keys"].tolist() == [1, 2, 3, 4, 5, 1, 2, 3]
  assert rows["query_start"].tolist() == list(range(9)) and rows["output_index"].tolist() == list(range(8))
  assert rows["query_index"][:, 0].tolist() == list(range(8)) and rows["query_pos"][:, 0].tolist() == rows["positions"].tolist()
  for row, seq in enumerate([0] * 5 + [1] * 3):
    np.testing.assert_array_equal(rows["block_tables"][row], multi["block_tables"][seq])
  assert prepare_batch(verifying([4, 4]), BLOCK, StepBuckets(16, decode_verify_tokens=8),
                       num_speculative_tokens=4).arrays["query_index"].shape == (2, 8)   # 10 tokens
  chunk = ScheduledSequence(Sequence("r", list(range(6)), SamplingParams(), seed=0), 0, 6, [50, 51], True)
  assert prepare_batch([*verifying([1]), chunk], BLOCK, StepBuckets(16, decode_verify_tokens=8),
                       num_speculative_tokens=1).arrays["query_index"].shape[1] == 8   # a prompt chunk beside it


def test_token_slice_spans_prompt_and_output() -> None:
  seq = Sequence("r", [1, 2, 3], SamplingParams(), seed=0, output_token_ids=[4, 5])
  for start in range(6):
    for end in range(start, 6): assert seq.token_slice(start, end) == [1, 2, 3, 4, 5][start:end]
