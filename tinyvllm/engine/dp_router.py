"""The data-parallel router: which engine replica a request goes to (a cache-aware load balancer, as SGLang's router and
vLLM's production-stack router are).

Each replica keeps its own prefix cache, so a request whose prompt starts as an earlier one's is cheapest where that
earlier one ran. The router remembers, per replica, the chained hashes of the full prompt blocks (block_size tokens) it
has sent there (least recently sent first out, at most as many as the replica has KV blocks: a picture of what its
cache can hold), and sends a request to the replica holding the longest run of its leading blocks, unless that replica
is much busier than the least-loaded one (more than BALANCE_ABS_THRESHOLD + BALANCE_REL_THRESHOLD x its outstanding
requests); otherwise, and when no replica holds any of its blocks, to the least-loaded replica (outstanding requests:
routed and not yet finished or aborted), ties taken in turn.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BALANCE_ABS_THRESHOLD = 4      # outstanding requests a cache hit may cost beyond the least-loaded replica's ...
BALANCE_REL_THRESHOLD = 2.0    # ... plus this many times the least-loaded replica's


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
  """One hash a full block, each covering the whole prefix up to its block's end (a chain, as the prefix cache's)."""
  hashes, h = [], 0
  for start in range(0, len(token_ids) - block_size + 1, block_size):
    h = hash((h, tuple(token_ids[start:start + block_size])))
    hashes.append(h)
  return hashes


class ReplicaPrefixes:
  """The block hashes sent to one replica, least recently sent first, at most `capacity` of them."""

  def __init__(self, capacity: int):
    self.capacity = max(capacity, 1)
    self.hashes: OrderedDict[int, None] = OrderedDict()

  def match(self, hashes: list[int]) -> int:
    """How many of the leading blocks this replica was sent."""
    n = 0
    while n < len(hashes) and hashes[n] in self.hashes: n += 1
    return n

  def add(self, hashes: list[int]) -> None:
    for h in hashes:
      self.hashes[h] = None
      self.hashes.move_to_end(h)
    while len(self.hashes) > self.capacity: self.hashes.popitem(last=False)


class PrefixRouter:
  def __init__(self, num_replicas: int, block_size: int, capacities: Sequence[int]):
    """capacities: per replica, how many block hashes to remember (its KV cache's blocks)."""
    assert num_replicas >= 1 and len(capacities) == num_replicas
    self.block_size = block_size
    self.prefixes = [ReplicaPrefixes(c) for c in capacities]
    self.load = [0] * num_replicas          # outstanding requests per replica
    self.owner: dict[str, int] = {}         # request id -> the replica it was sent to
    self._turn = 0                          # where the next tie between least-loaded replicas starts

  def route(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
    """Choose the replica for a request, and count it there until `release`."""
    hashes = block_hashes(prompt_token_ids, self.block_size)
    replica = self.choose(hashes)
    self.prefixes[replica].add(hashes)
    self.owner[request_id] = replica
    self.load[replica] += 1
    return replica

  def choose(self, hashes: list[int]) -> int:
    """The replica holding the longest run of the leading blocks unless it is much busier; else the least loaded."""
    matches = [p.match(hashes) for p in self.prefixes]
    best, floor = max(matches), min(self.load)
    if best:
      cached = min((i for i, m in enumerate(matches) if m == best), key=lambda i: self.load[i])
      if self.load[cached] <= floor + BALANCE_ABS_THRESHOLD + BALANCE_REL_THRESHOLD * floor: return cached
    return self.least_loaded()

  def least_loaded(self) -> int:
    """The replica with the fewest outstanding requests; among equals, the next in turn."""
    n, low = len(self.load), min(self.load)
    i = next(i for i in ((self._turn + k) % n for k in range(n)) if self.load[i] == low)
    self._turn = (i + 1) % n
    return i

  def release(self, request_id: str) -> None:
    """The request finished, was aborted or refused: it no longer counts (unknown ids are ignored)."""
    replica = self.owner.pop(request_id, None)
    if replica is not None: self.load[replica] -= 1
