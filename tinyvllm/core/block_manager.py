"""BlockManager: the paged KV cache's bookkeeping (plain Python, no tensors).

Physical blocks of `block_size` token slots live on a free list; each sequence maps its logical blocks to physical
ones through its block table, growing on demand. Blocks are reference counted so that sequences can share them:
forks (n > 1) share the prompt's blocks, and the first write into a shared, partly filled block copies it
(copy-on-write). With prefix caching, every full block is keyed by a hash of its tokens chained with the previous
block's hash; a new sequence reuses the cached blocks of its prompt, and freed cached blocks stay reusable until the
free list evicts them in LRU order. The block manager owns each sequence's block table (`block_table(seq)`); the
scheduler is its only caller.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from tinyvllm.core.sequence import Sequence

BlockCopy = tuple[int, int]  # (source block, destination block)


@dataclass
class Block:
  block_id: int
  ref_count: int = 0
  block_hash: int | None = None         # set once the block is full and registered in the prefix cache
  token_ids: tuple[int, ...] = ()       # the cached block's tokens and its predecessor's hash, so that a hash
  parent_hash: int | None = None        # collision can never hand out a block with other content


def chain_hash(previous: int | None, tokens: Seq[int]) -> int:
  return hash((previous, tuple(tokens)))


@dataclass
class SequenceBlocks:
  """What the block manager keeps per sequence."""
  table: list[int] = field(default_factory=list)    # physical block of each logical block
  hashes: list[int] = field(default_factory=list)   # chained hashes of its full blocks (memoised, prefix caching)
  registered: int = 0                               # leading blocks already entered in the prefix cache


class BlockManager:
  def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
    self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
    self.blocks = [Block(i) for i in range(num_blocks)]
    self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)  # LRU first
    self.cached: dict[int, Block] = {}                   # block hash -> full, cached block
    self.seqs: dict[int, SequenceBlocks] = {}            # seq id -> its table (and hashes, while it may need them)
    self.prefix_hits = self.prefix_queries = 0           # in tokens

  # ---- counters ----
  @property
  def num_free_blocks(self) -> int: return len(self.free_queue)

  @property
  def num_used_blocks(self) -> int: return self.num_blocks - len(self.free_queue)

  @property
  def num_cached_blocks(self) -> int: return len(self.cached)

  @property
  def num_cached_free_blocks(self) -> int: return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

  @property
  def prefix_hit_rate(self) -> float: return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

  def blocks_for(self, num_tokens: int) -> int: return -(-num_tokens // self.block_size)

  def block_table(self, seq: Sequence) -> list[int]:
    """seq's blocks (the live list: it grows as the sequence does); empty while it holds none."""
    record = self.seqs.get(seq.seq_id)
    return record.table if record is not None else []

  # ---- prefix cache ----
  def _block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
    """Chained hashes of seq's full blocks within its first num_tokens tokens (memoised on the sequence)."""
    hashes = self.seqs.setdefault(seq.seq_id, SequenceBlocks()).hashes
    while len(hashes) < num_tokens // self.block_size:
      start = len(hashes) * self.block_size
      hashes.append(chain_hash(hashes[-1] if hashes else None, seq.token_slice(start, start + self.block_size)))
    return hashes[:num_tokens // self.block_size]

  def cached_prefix(self, seq: Sequence) -> list[Block]:
    """The cached blocks that hold a prefix of seq's tokens; the last token is always left to compute. None for a
    request that asked for prompt logprobs: they come from computing every prompt token (as in vLLM)."""
    if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None: return []
    hits, tokens, parent = [], seq.token_ids, None
    for i, block_hash in enumerate(self._block_hashes(seq, seq.num_tokens - 1)):
      block = self.cached.get(block_hash)
      if block is None or block.parent_hash != parent or \
         block.token_ids != tuple(tokens[i * self.block_size:(i + 1) * self.block_size]): break
      hits.append(block)
      parent = block_hash
    return hits

  def register_computed(self, seq: Sequence) -> None:
    """Enter seq's newly completed full blocks into the prefix cache (call after its tokens were computed)."""
    if not self.enable_prefix_caching: return
    hashes, record = self._block_hashes(seq, seq.num_computed_tokens), self.seqs[seq.seq_id]
    for i in range(record.registered, len(hashes)):
      block = self.blocks[record.table[i]]
      if block.block_hash is None and hashes[i] not in self.cached:
        block.block_hash, block.parent_hash = hashes[i], hashes[i - 1] if i else None
        block.token_ids = tuple(seq.token_slice(i * self.block_size, (i + 1) * self.block_size))
        self.cached[hashes[i]] = block
    record.registered = len(hashes)

  # ---- allocation ----
  def _take_free(self) -> Block:
    _, block = self.free_queue.popitem(last=False)
    if block.block_hash is not None:  # evict its cache entry: the block gets new content
      if self.cached.get(block.block_hash) is block: del self.cached[block.block_hash]
      block.block_hash, block.parent_hash, block.token_ids = None, None, ()
    block.ref_count = 1
    return block

  def _acquire(self, block: Block) -> None:
    if block.ref_count == 0: del self.free_queue[block.block_id]
    block.ref_count += 1

  def _release(self, block: Block) -> None:
    block.ref_count -= 1
    assert block.ref_count >= 0, f"block {block.block_id} released more often than acquired"
    if block.ref_count == 0: self.free_queue[block.block_id] = block  # most recently used end

  def can_allocate(self, seq: Sequence, num_new_tokens: int, num_seqs: int = 1, releasing: Seq[Sequence] = ()) -> bool:
    """Whether a waiting sequence can start: room for its cached prefix plus num_new_tokens more (the chunk, which
    cannot run past the sequence's end: a chunk sized before the cache was consulted must not count the cached
    prefix twice), once the `releasing` sequences (about to be preempted) gave their blocks back.

    Forks (num_seqs > 1) share its blocks, so they need nothing now."""
    hits = self.cached_prefix(seq)
    needed = self.blocks_for(min(len(hits) * self.block_size + num_new_tokens, seq.num_tokens)) - len(hits)
    return self._room_for(needed, hits, releasing)

  def _room_for(self, fresh: int, hits: list[Block], releasing: Seq[Sequence]) -> bool:
    """Whether `fresh` new blocks plus the cached `hits` fit once `releasing` gave their blocks back (a hit on the free
    list leaves it when it is taken, so it counts against the free blocks)."""
    freed = self._freed_by(releasing)
    reusable_free = sum(1 for b in hits if b.ref_count == 0 or b.block_id in freed)
    return fresh + reusable_free <= self.num_free_blocks + len(freed)

  def _freed_by(self, seqs: Seq[Sequence]) -> set[int]:
    """The blocks that would be free if seqs released theirs (a block others share stays theirs)."""
    held = Counter(block_id for seq in seqs for block_id in self.block_table(seq))
    return {block_id for block_id, count in held.items() if self.blocks[block_id].ref_count == count}

  def allocate(self, seq: Sequence, num_seqs: int = 1) -> int:
    """Attach the cached prefix to a waiting sequence; returns how many tokens it covers (now computed)."""
    assert not self.block_table(seq), f"sequence {seq.seq_id} already holds blocks"
    hits = self.cached_prefix(seq)
    for block in hits: self._acquire(block)
    record = self.seqs.setdefault(seq.seq_id, SequenceBlocks())
    record.table, record.registered = [b.block_id for b in hits], len(hits)
    cached_tokens = len(hits) * self.block_size
    self.prefix_queries += len(seq.prompt_token_ids)
    self.prefix_hits += min(cached_tokens, len(seq.prompt_token_ids))
    return cached_tokens

  def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
    return self._new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

  def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
    needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(self.block_table(seq))
    return max(needed, 0) + (1 if self._needs_copy(seq, num_new_tokens) else 0)

  def _needs_copy(self, seq: Sequence, num_new_tokens: int) -> bool:
    """The next write lands in a partly filled block that others share."""
    offset = seq.num_computed_tokens % self.block_size
    if num_new_tokens == 0 or offset == 0: return False
    return self.blocks[self.block_table(seq)[seq.num_computed_tokens // self.block_size]].ref_count > 1

  def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
    """Give seq room for num_new_tokens more K/V entries; returns block copies the runner must do first (COW)."""
    assert self.can_append(seq, num_new_tokens), f"no room for {num_new_tokens} tokens of sequence {seq.seq_id}"
    copies, table = [], self.seqs.setdefault(seq.seq_id, SequenceBlocks()).table
    if self._needs_copy(seq, num_new_tokens):
      index = seq.num_computed_tokens // self.block_size
      shared, fresh = self.blocks[table[index]], self._take_free()
      self._release(shared)
      table[index] = fresh.block_id
      copies.append((shared.block_id, fresh.block_id))
    while len(table) < self.blocks_for(seq.num_computed_tokens + num_new_tokens): table.append(self._take_free().block_id)
    return copies

  def trim(self, seq: Sequence) -> None:
    """Free seq's blocks past its computed tokens (slots taken for proposals that were rejected), last first."""
    table = self.block_table(seq)
    while len(table) > self.blocks_for(seq.num_computed_tokens): self._release(self.blocks[table.pop()])

  def fork(self, parent: Sequence, child: Sequence) -> list[BlockCopy]:
    """The child shares all of the parent's blocks (copy-on-write happens on its first write)."""
    record = self.seqs[parent.seq_id]
    for block_id in record.table: self._acquire(self.blocks[block_id])
    self.seqs[child.seq_id] = SequenceBlocks(list(record.table), list(record.hashes), record.registered)
    return []

  def free(self, seq: Sequence) -> None:
    """Release seq's blocks (if any), tail first, so that LRU eviction takes a prompt's tail before its shared head,
    and forget the sequence."""
    record = self.seqs.pop(seq.seq_id, None)
    for block_id in reversed(record.table if record is not None else []): self._release(self.blocks[block_id])

  # ---- swapping (preemption_mode swap) ----
  def swap_out(self, seq: Sequence) -> list[int]:
    """Release seq's device blocks, tail first, and return them in table order: their contents go to the swap space
    before the next step runs. A block others share stays on the device for them. The sequence keeps its memoised
    hashes; its blocks are entered in the prefix cache again once it is back."""
    record = self.seqs[seq.seq_id]
    table, record.table, record.registered = record.table, [], 0
    for block_id in reversed(table): self._release(self.blocks[block_id])
    return table

  def _swap_in_hits(self, seq: Sequence) -> list[Block]:
    """The leading full blocks of a swapped-out sequence that the prefix cache still holds (no copy needed)."""
    return self.cached_prefix(seq)[:seq.num_computed_tokens // self.block_size]

  def can_swap_in(self, seq: Sequence, num_new_tokens: int, releasing: Seq[Sequence] = ()) -> bool:
    """Whether a swapped-out sequence can come back with room for num_new_tokens more (see can_allocate)."""
    hits = self._swap_in_hits(seq)
    return self._room_for(self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(hits), hits, releasing)

  def swap_in(self, seq: Sequence, num_blocks: int) -> int:
    """Give a swapped-out sequence its num_blocks blocks back: the prefix cache's where it still holds them, fresh ones
    for the rest (their contents come back from the swap space before the step). Returns how many leading blocks
    came from the prefix cache."""
    assert not self.block_table(seq), f"sequence {seq.seq_id} already holds blocks"
    hits = self._swap_in_hits(seq)
    for block in hits: self._acquire(block)
    record = self.seqs.setdefault(seq.seq_id, SequenceBlocks())
    record.table = [b.block_id for b in hits] + [self._take_free().block_id for _ in range(num_blocks - len(hits))]
    return len(hits)

  def reset_prefix_cache(self) -> None:
    for block in self.cached.values(): block.block_hash, block.parent_hash, block.token_ids = None, None, ()
    self.cached.clear()
