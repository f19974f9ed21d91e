"""BlockManager and ContiguousAllocator bookkeeping: plain Python, no tensors, no model."""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

import pytest

from tinyvllm.core import block_manager as bm_module
from tinyvllm.core.block_manager import BlockCopy, BlockManager
from tinyvllm.core.contiguous_allocator import ContiguousAllocator
from tinyvllm.core.sequence import Sequence
from tinyvllm.sampling_params import SamplingParams


# ---- helpers (also used by test_scheduler.py) ----
def make_seq(prompt: list[int], max_tokens: int = 8, n: int = 1, rid: str = "r", index: int = 0, priority: int = 0,
             group: str | None = None) -> Sequence:
  return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True), seed=0, index=index,
                  priority=priority, group=group)


def check_invariants(bm: BlockManager, seqs: Iterable[Sequence]) -> None:
  """No block is handed out twice while referenced, and the prefix cache only maps blocks holding what it claims."""
  seqs = list(seqs)
  refs = Counter(b for s in seqs for b in bm.block_table(s))
  for s in seqs:
    table = bm.block_table(s)
    assert len(set(table)) == len(table), f"seq {s.seq_id} holds a block twice: {table}"
    if table: assert len(table) >= bm.blocks_for(s.num_computed_tokens)  # (a freed one holds none)
  for b in bm.blocks:
    assert b.ref_count == refs.get(b.block_id, 0), f"block {b.block_id}: ref {b.ref_count}, tables {refs.get(b.block_id, 0)}"
  assert set(bm.free_queue) == {b.block_id for b in bm.blocks if b.ref_count == 0}
  assert all(bm.free_queue[k] is bm.blocks[k] for k in bm.free_queue)
  assert bm.num_used_blocks == len(refs) and bm.num_free_blocks == bm.num_blocks - len(refs)
  for h, b in bm.cached.items():
    assert b.block_hash == h and len(b.token_ids) == bm.block_size
    assert bm_module.chain_hash(b.parent_hash, b.token_ids) == h
  for b in bm.blocks:
    if b.block_hash is not None: assert bm.cached.get(b.block_hash) is b
  assert bm.num_cached_free_blocks == sum(1 for b in bm.cached.values() if b.ref_count == 0)
  for s in seqs:  # a cached block in a table holds exactly that sequence's tokens at that position
    for i, block_id in enumerate(bm.block_table(s)):
      block = bm.blocks[block_id]
      if block.block_hash is None: continue
      assert (i + 1) * bm.block_size <= s.num_computed_tokens
      assert block.token_ids == tuple(s.token_ids[i * bm.block_size:(i + 1) * bm.block_size])


def compute(bm: BlockManager, s: Sequence, n: int) -> list[BlockCopy]:
  """What one engine step does to a scheduled sequence: room for n tokens, then they are computed."""
  copies = bm.append_slots(s, n)
  s.num_computed_tokens += n
  bm.register_computed(s)
  return copies


def prefill(bm: BlockManager, s: Sequence) -> int:
  cached = bm.allocate(s)
  s.num_computed_tokens = cached
  compute(bm, s, s.num_uncomputed_tokens)
  return cached


def decode(bm: BlockManager, s: Sequence, token: int) -> list[BlockCopy]:
  s.output_token_ids.append(token)
  return compute(bm, s, 1)


def refs(bm: BlockManager, ids: Iterable[int]) -> list[int]: return [bm.blocks[i].ref_count for i in ids]


# ---- allocation, counters, free ----
def test_blocks_grow_on_demand_and_free_returns_all():
  bm = BlockManager(10, 4)
  s = make_seq(range(5))
  assert bm.allocate(s) == 0 and bm.block_table(s) == []
  compute(bm, s, 5)
  assert bm.block_table(s) == [0, 1]
  for k in range(10):
    decode(bm, s, 100 + k)
    assert len(bm.block_table(s)) == -(-s.num_computed_tokens // 4)
    assert bm.block_table(s) == list(range(len(bm.block_table(s))))
    assert bm.num_used_blocks == len(bm.block_table(s)) and bm.num_free_blocks == 10 - len(bm.block_table(s))
    check_invariants(bm, [s])
  assert s.num_computed_tokens == 15 and bm.block_table(s) == [0, 1, 2, 3]
  assert bm.num_cached_blocks == 3 and bm.num_cached_free_blocks == 0  # three full blocks, all in use
  bm.free(s)
  assert bm.block_table(s) == [] and s.seq_id not in bm.seqs
  assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0 and refs(bm, range(10)) == [0] * 10
  assert bm.num_cached_blocks == 3 and bm.num_cached_free_blocks == 3
  assert list(bm.free_queue) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]  # freed tail first, at the most recently used end
  check_invariants(bm, [s])


def test_blocks_for():
  bm = BlockManager(4, 4)
  assert [bm.blocks_for(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_can_allocate_exact_boundary():
  bm = BlockManager(3, 4)
  assert bm.can_allocate(make_seq(range(12)), 12)
  assert not bm.can_allocate(make_seq(range(13)), 13)
  assert bm.can_allocate(make_seq(range(13)), 12)  # a first chunk of 12 tokens fits
  holder = make_seq([90])
  prefill(bm, holder)
  assert bm.num_free_blocks == 2
  assert bm.can_allocate(make_seq(range(8)), 8)
  assert not bm.can_allocate(make_seq(range(9)), 9)


def test_can_append_exact_boundary():
  bm = BlockManager(2, 4)
  s = make_seq(range(4))
  prefill(bm, s)
  assert bm.block_table(s) == [0] and bm.num_free_blocks == 1
  assert bm.can_append(s, 4) and not bm.can_append(s, 5)
  other = make_seq([7, 7, 7])
  prefill(bm, other)
  assert bm.block_table(other) == [1] and bm.num_free_blocks == 0
  assert not bm.can_append(s, 1)  # s's block is full: its next token needs a new block
  assert bm.can_append(other, 1) and not bm.can_append(other, 2)  # one slot left in other's block
  assert bm.append_slots(other, 1) == [] and bm.block_table(other) == [1]
  with pytest.raises(AssertionError):
    bm.append_slots(s, 1)


# ---- forks and copy-on-write ----
def test_fork_shares_blocks():
  bm = BlockManager(8, 4)
  parent, child = make_seq(range(6)), make_seq(range(6), index=1)
  prefill(bm, parent)
  assert bm.block_table(parent) == [0, 1] and bm.seqs[parent.seq_id].registered == 1
  assert bm.fork(parent, child) == []
  assert bm.block_table(child) == [0, 1] and bm.block_table(child) is not bm.block_table(parent)
  assert bm.seqs[child.seq_id].registered == 1
  assert refs(bm, [0, 1]) == [2, 2] and bm.num_used_blocks == 2
  child.num_computed_tokens = parent.num_computed_tokens
  check_invariants(bm, [parent, child])
  bm.free(parent)
  assert refs(bm, [0, 1]) == [1, 1] and bm.num_used_blocks == 2
  bm.free(child)
  assert bm.num_used_blocks == 0
  check_invariants(bm, [parent, child])


def forked(bm: BlockManager, prompt: list[int], n: int) -> list[Sequence]:
  seqs = [make_seq(prompt, index=i) for i in range(n)]
  prefill(bm, seqs[0])
  for child in seqs[1:]:
    bm.fork(seqs[0], child)
    child.num_computed_tokens = seqs[0].num_computed_tokens
  return seqs


def test_copy_on_write_of_shared_partly_filled_block():
  bm = BlockManager(8, 4)
  parent, child1, child2 = forked(bm, list(range(6)), 3)
  assert refs(bm, [0, 1]) == [3, 3]
  assert bm.can_append(parent, 1) and bm._new_blocks_needed(parent, 1) == 1
  assert decode(bm, parent, 50) == [(1, 2)]
  assert bm.block_table(parent) == [0, 2] and refs(bm, [0, 1, 2]) == [3, 2, 1]
  assert decode(bm, child1, 51) == [(1, 3)]
  assert bm.block_table(child1) == [0, 3] and refs(bm, [0, 1, 3]) == [3, 1, 1]
  assert decode(bm, child2, 52) == []  # the last sharer writes in place
  assert bm.block_table(child2) == [0, 1] and refs(bm, [0, 1]) == [3, 1]
  assert decode(bm, parent, 53) == [] and bm.block_table(parent) == [0, 2]  # no longer shared
  check_invariants(bm, [parent, child1, child2])


def test_no_copy_when_shared_last_block_is_full():
  bm = BlockManager(8, 4)
  parent, child = forked(bm, list(range(8)), 2)
  assert decode(bm, parent, 50) == []
  assert bm.block_table(parent) == [0, 1, 2] and refs(bm, [0, 1, 2]) == [2, 2, 1]
  assert decode(bm, child, 51) == []
  assert bm.block_table(child) == [0, 1, 3] and refs(bm, [0, 1, 3]) == [2, 2, 1]
  check_invariants(bm, [parent, child])


def test_can_append_counts_the_copy():
  bm = BlockManager(2, 4)
  parent, child = forked(bm, list(range(6)), 2)
  assert bm.num_free_blocks == 0
  parent.output_token_ids.append(50)
  assert not bm.can_append(parent, 1)  # the write needs a private copy of block 1, and nothing is free
  bm.free(child)
  assert bm.can_append(parent, 1) and bm.append_slots(parent, 1) == []


def test_copy_and_growth_in_one_append():
  bm = BlockManager(8, 4)
  parent, _child = forked(bm, list(range(6)), 2)
  parent.output_token_ids += [50, 51, 52, 53]
  assert bm._new_blocks_needed(parent, 4) == 2
  assert bm.append_slots(parent, 4) == [(1, 2)]
  assert bm.block_table(parent) == [0, 2, 3] and refs(bm, [0, 1, 2, 3]) == [2, 1, 1, 1]


def test_random_operations_keep_invariants():
  rng = random.Random(0)
  bm = BlockManager(24, 4)
  bases = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
  live: list[Sequence] = []
  everyone: list[Sequence] = []
  for _ in range(600):
    op = rng.random()
    if op < 0.3:
      base = rng.choice(bases)
      s = make_seq(base[:rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(0, 5))])
      if bm.can_allocate(s, s.num_tokens):
        prefill(bm, s)
        live.append(s)
        everyone.append(s)
    elif op < 0.65 and live:
      s = rng.choice(live)
      s.output_token_ids.append(rng.randrange(50))
      if bm.can_append(s, 1): compute(bm, s, 1)
      else: s.output_token_ids.pop()
    elif op < 0.8 and live:
      parent = rng.choice(live)
      child = make_seq(parent.prompt_token_ids, index=1)
      child.output_token_ids = list(parent.output_token_ids)
      bm.fork(parent, child)
      child.num_computed_tokens = parent.num_computed_tokens
      live.append(child)
      everyone.append(child)
    elif live:
      s = live.pop(rng.randrange(len(live)))
      bm.free(s)
    check_invariants(bm, everyone)
  for s in live: bm.free(s)
  check_invariants(bm, everyone)
  assert bm.num_free_blocks == 24 and bm.prefix_hits > 0


# ---- the contiguous baseline ----
def test_contiguous_allocator_rows():
  ca = ContiguousAllocator(4, 32)
  assert ca.blocks_for(1000) == 1 and ca.num_free_blocks == 4
  a, b = make_seq(range(5)), make_seq(range(6))
  assert ca.can_allocate(a, 5) and ca.allocate(a) == 0 and ca.block_table(a) == [0]
  assert ca.allocate(b) == 0 and ca.block_table(b) == [1] and ca.num_used_blocks == 2
  a.num_computed_tokens = 30
  assert ca.can_append(a, 2) and not ca.can_append(a, 3)
  assert ca.append_slots(a, 2) == []
  with pytest.raises(AssertionError):
    ca.allocate(a)
  ca.free(a)
  assert ca.block_table(a) == [] and ca.num_free_blocks == 3
  assert ca.allocate(make_seq([1])) == 0 and ca.free_rows == [3, 2]


def test_contiguous_allocator_forks_copy_reserved_rows():
  ca = ContiguousAllocator(5, 16)
  parent = make_seq(range(5), n=3)
  c1, c2 = make_seq(range(5), index=1), make_seq(range(5), index=2)
  assert ca.can_allocate(parent, 5, 3) and not ca.can_allocate(parent, 5, 6)
  ca.allocate(parent, 3)
  assert ca.block_table(parent) == [0] and ca.reserved[parent.seq_id] == [1, 2] and ca.num_free_blocks == 2
  assert not ca.can_allocate(make_seq([1], n=3), 1, 3)
  assert ca.fork(parent, c1) == [(0, 2)] and ca.block_table(c1) == [2]
  assert ca.reserved[parent.seq_id] == [1]
  ca.free(parent)  # the parent's row and its unused reserved row
  assert parent.seq_id not in ca.reserved and sorted(ca.free_rows) == [0, 1, 3, 4]
  with pytest.raises(KeyError):
    ca.fork(parent, c2)
  ca.free(c1)
  assert ca.num_free_blocks == 5 and ca.num_used_blocks == 0
  ca.register_computed(c1)  # no prefix cache: a no-op
