"""The BlockManager's prefix cache: full blocks reused by chained hash, verified against their tokens and parent, LRU
eviction tail first, and admission counting a cached prefix once. Plain Python, no tensors, no model."""
from __future__ import annotations

import pytest

from tests.test_block_manager import check_invariants, compute, make_seq, prefill, refs
from tinyvllm.core import block_manager as bm_module
from tinyvllm.core.block_manager import BlockManager


def test_prefix_cache_reuses_full_blocks():
  bm = BlockManager(10, 4)
  a, b = make_seq(range(10)), make_seq(range(10))
  assert prefill(bm, a) == 0
  assert bm.block_table(a) == [0, 1, 2] and bm.num_cached_blocks == 2
  assert bm.prefix_queries == 10 and bm.prefix_hits == 0
  assert bm.can_allocate(b, 10)
  assert bm.allocate(b) == 8
  assert bm.block_table(b) == [0, 1] and bm.seqs[b.seq_id].registered == 2 and refs(bm, [0, 1, 2]) == [2, 2, 1]
  assert bm.prefix_queries == 20 and bm.prefix_hits == 8 and bm.prefix_hit_rate == pytest.approx(0.4)
  b.num_computed_tokens = 8
  compute(bm, b, 2)
  assert bm.block_table(b) == [0, 1, 3]
  check_invariants(bm, [a, b])


def test_prefix_cache_never_covers_the_last_prompt_token():
  bm = BlockManager(10, 4)
  a, b = make_seq(range(8)), make_seq(range(8))
  prefill(bm, a)
  assert bm.block_table(a) == [0, 1] and bm.num_cached_blocks == 2
  assert bm.allocate(b) == 4  # block 1 is cached too, but the last token must be computed to sample
  assert bm.block_table(b) == [0]
  b.num_computed_tokens = 4
  compute(bm, b, 4)
  assert bm.block_table(b) == [0, 2]
  assert bm.blocks[2].block_hash is None and bm.num_cached_blocks == 2  # a duplicate is not entered twice
  check_invariants(bm, [a, b])


def test_partial_prefix_match_stops_at_first_differing_block():
  bm = BlockManager(16, 4)
  a = make_seq(range(13))
  prefill(bm, a)
  assert bm.num_cached_blocks == 3
  b = make_seq([*range(4), 99, 98, 97, 96, *range(8, 13)])  # block 1 differs, block 2 equal in tokens
  assert [blk.block_id for blk in bm.cached_prefix(b)] == [0]
  assert bm.allocate(b) == 4 and bm.block_table(b) == [0]
  c = make_seq([*range(10), 77])
  assert bm.allocate(c) == 8 and bm.block_table(c) == [0, 1]
  assert refs(bm, [0, 1, 2]) == [3, 2, 1]


def test_cached_blocks_survive_free_and_are_reused():
  bm = BlockManager(6, 4)
  a = make_seq(range(9))
  prefill(bm, a)
  bm.free(a)
  assert list(bm.free_queue) == [3, 4, 5, 2, 1, 0] and bm.num_cached_free_blocks == 2
  b = make_seq(range(9))
  assert bm.can_allocate(b, 9)
  assert bm.allocate(b) == 8 and bm.block_table(b) == [0, 1]
  assert refs(bm, [0, 1]) == [1, 1] and bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 4
  b.num_computed_tokens = 8
  compute(bm, b, 1)
  assert bm.block_table(b) == [0, 1, 3]  # the fresh block comes from the LRU end
  check_invariants(bm, [a, b])


def test_eviction_is_lru_tail_first():
  bm = BlockManager(4, 4)
  prompt = list(range(13))
  a = make_seq(prompt)
  prefill(bm, a)
  assert bm.block_table(a) == [0, 1, 2, 3] and bm.num_cached_blocks == 3
  bm.free(a)
  assert list(bm.free_queue) == [3, 2, 1, 0]  # tail first: the partial block, then the prompt's last full block
  x, y = make_seq([50, 51]), make_seq([60, 61])
  prefill(bm, x)
  assert bm.block_table(x) == [3] and bm.num_cached_blocks == 3  # the uncached block went first
  prefill(bm, y)
  assert bm.block_table(y) == [2] and bm.num_cached_blocks == 2  # then the tail of the cached prompt
  b = make_seq(prompt)
  assert [blk.block_id for blk in bm.cached_prefix(b)] == [0, 1]  # the cache was too small: the head survived
  assert not bm.can_allocate(b, 13)  # 2 hits + 2 new blocks, 2 blocks free
  bm.free(x)
  assert not bm.can_allocate(b, 13)
  bm.free(y)
  assert bm.can_allocate(b, 13)
  assert bm.allocate(b) == 8 and bm.block_table(b) == [0, 1]
  assert bm.prefix_hits == 8 and bm.prefix_queries == 2 * 13 + 2 + 2
  b.num_computed_tokens = 8
  check_invariants(bm, [a, b, x, y])


def test_recently_reused_prefix_outlives_older_blocks():
  bm = BlockManager(4, 4)
  a, b = make_seq([*range(4), 9]), make_seq([*range(10, 14), 9])
  prefill(bm, a)
  prefill(bm, b)
  bm.free(a)
  bm.free(b)
  assert list(bm.free_queue) == [1, 0, 3, 2]
  again = make_seq([*range(4), 5])  # touches a's block 0: it becomes most recently used when freed
  assert prefill(bm, again) == 4
  bm.free(again)
  assert list(bm.free_queue) == [3, 2, 1, 0]
  for filler in ([70], [71], [72]):
    prefill(bm, make_seq(filler))
  assert bm.num_cached_blocks == 1 and bm.blocks[0].block_hash is not None  # b's block 2 went, a's block 0 stayed


def test_forged_hash_collision_is_rejected(monkeypatch: pytest.MonkeyPatch):
  monkeypatch.setattr(bm_module, "chain_hash", lambda previous, tokens: 7)  # every block collides
  bm = BlockManager(8, 4)
  a = make_seq([1, 2, 3, 4, 5])
  prefill(bm, a)
  assert list(bm.cached) == [7] and bm.cached[7].block_id == 0
  b = make_seq([9, 9, 9, 9, 5])
  assert bm.cached_prefix(b) == [] and bm.allocate(b) == 0
  compute(bm, b, 5)
  assert bm.block_table(b) == [2, 3] and bm.blocks[2].block_hash is None and bm.cached[7].block_id == 0
  c = make_seq([1, 2, 3, 4, 6])
  assert bm.allocate(c) == 4 and bm.block_table(c) == [0]  # the genuine match still hits
  c.num_computed_tokens = 4
  check_invariants(bm, [a, b, c])


def test_forged_parent_is_rejected():
  bm = BlockManager(8, 4)
  a = make_seq(range(9))
  prefill(bm, a)
  assert [blk.block_id for blk in bm.cached_prefix(make_seq(range(9)))] == [0, 1]
  bm.blocks[1].parent_hash = 12345  # same hash and tokens, other predecessor
  assert [blk.block_id for blk in bm.cached_prefix(make_seq(range(9)))] == [0]
  bm.blocks[1].parent_hash, bm.blocks[1].token_ids = bm.blocks[0].block_hash, (4, 5, 6, 99)
  assert [blk.block_id for blk in bm.cached_prefix(make_seq(range(9)))] == [0]


def test_prefix_caching_disabled():
  bm = BlockManager(8, 4, enable_prefix_caching=False)
  a, b = make_seq(range(9)), make_seq(range(9))
  prefill(bm, a)
  assert bm.num_cached_blocks == 0 and bm.seqs[a.seq_id].registered == 0
  bm.free(a)
  assert bm.allocate(b) == 0 and bm.block_table(b) == []
  assert bm.prefix_hits == 0 and bm.prefix_hit_rate == 0.0 and bm.num_cached_free_blocks == 0


def test_reset_prefix_cache():
  bm = BlockManager(8, 4)
  a = make_seq(range(9))
  prefill(bm, a)
  bm.free(a)
  bm.reset_prefix_cache()
  assert bm.num_cached_blocks == 0 and all(b.block_hash is None for b in bm.blocks)
  assert bm.allocate(make_seq(range(9))) == 0


def test_can_allocate_counts_cached_prefix_once():
  """A 33-token prompt needs 3 blocks, 2 of them cached: with the whole cache (4 blocks) free it must fit."""
  bm = BlockManager(4, 16)
  first = make_seq(range(33))
  prefill(bm, first)
  bm.free(first)
  again = make_seq(range(33))
  assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
  assert bm.can_allocate(again, 33)  # the chunk the scheduler asks for before the cache is consulted
  assert bm.can_allocate(again, 16) and bm.can_allocate(again, 1)
  assert bm.allocate(again) == 32 and bm.block_table(again) == [0, 1]
  again.num_computed_tokens = 32
  compute(bm, again, 1)
  assert bm.block_table(again) == [0, 1, 3]
  check_invariants(bm, [first, again])


def test_can_allocate_with_cached_prefix_exact_boundary():
  bm = BlockManager(3, 4)
  first = make_seq(range(12))
  prefill(bm, first)
  bm.free(first)
  assert bm.num_cached_free_blocks == 3
  longer = make_seq([*range(12), 1, 2, 3, 4, 5])  # 3 hits + 2 new blocks > 3
  assert len(bm.cached_prefix(longer)) == 3
  assert not bm.can_allocate(longer, 17) and not bm.can_allocate(longer, 1)  # even 1 token past the hits needs a 4th
  same = make_seq(range(12))  # 2 hits (the last token is computed) + 1 new block
  assert bm.can_allocate(same, 12) and bm.allocate(same) == 8
  same.num_computed_tokens = 8
  compute(bm, same, 4)
  assert bm.block_table(same) == [0, 1, 2] and bm.num_free_blocks == 0
  check_invariants(bm, [first, same])


