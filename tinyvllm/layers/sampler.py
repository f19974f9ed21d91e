"""Batched sampling on the device: penalties, temperature, top-k / top-p / min-p, seeded Gumbel-max, logprobs.

One decode step's logits [B, V] become one token id per row in a single tinygrad graph with static shapes, so it can be
captured by TinyJit per batch bucket. Per-row settings arrive as tensors (`SamplingBatch` builds them on the host);
`SamplerVariant` only chooses which features are compiled in. Semantics follow vLLM (v1 sampler):
  penalties (all rows) -> greedy argmax for temperature 0 | logits / T -> min-p, top-k, then top-p on the renormalised
  survivors -> Gumbel-max with noise hashed from (seed, step, token id), so a row's draw ignores the rest of the batch.
No sort: top-k and top-p thresholds are found by a radix search over the float32 bit pattern (see `_search_max`).

Cost, one TinyJit replay on the 2-core CPU for B=4, V=151936 (every pass reads [B, V] once, so GPUs scale alike):
greedy 1 ms; + penalties 5 ms (zero fill + scatter + one elementwise kernel); random 10 ms (hash + two logs per
element, tinygrad's log is a polynomial on the CPU); random + filters 41 ms (8 + 8 threshold passes at ~2.5 ms);
everything 44 ms; compute_logprobs k=20: 9 ms (k passes).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor, dtypes

from tinyvllm.backend.sampling import (
  FREQUENCY,
  GREEDY_EPS,
  MIN_P,
  NEUTRAL_PARAMS,
  PRESENCE,
  REPETITION,
  TEMPERATURE,
  TOP_K,
  TOP_P,
  SamplerVariant,
)
from tinyvllm.layers.scatter import scatter_rows
from tinyvllm.layers.top_k import from_order_key, order_key, top_k
from tinyvllm.sampling_params import SamplingParams

RADIX_BITS = 4  # bits of a threshold decided per pass over [B, V] (see _search_max)
MIN_PENALTY_LEN = 16  # penalty arrays are padded to a power of two >= this, so JIT captures are reused
_U32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
  """Host-side arrays for one step, padded to B rows (padding rows: greedy, no filters, no penalties).

  penalty_index [B, L] int32: b * V + token for each token row b has seen (prompt or output), -1 for padding.
  penalty_value [B, L, 2] float32: (count of the token in the output, 1.0 seen flag).
  """
  params: np.ndarray  # [B, 7] float32: temperature, top_k, top_p, min_p, presence, frequency, repetition
  rng: np.ndarray  # [B, 2] uint32: seed, step
  penalty_index: np.ndarray | None
  penalty_value: np.ndarray | None
  variant: SamplerVariant

  @staticmethod
  def build(params: list[SamplingParams], seeds: list[int], steps: list[int],
            histories: list[tuple[Sequence[int], Sequence[int]]] | None, padded_rows: int,
            vocab_size: int) -> SamplingBatch:
    n = len(params)
    if not (len(seeds) == len(steps) == n <= padded_rows):
      raise ValueError("params/seeds/steps lengths or padded_rows")
    table = np.tile(np.array(NEUTRAL_PARAMS, np.float32), (padded_rows, 1))
    if n: table[:n] = np.array([(p.temperature, min(p.top_k, vocab_size), p.top_p, p.min_p, p.presence_penalty,
                                 p.frequency_penalty, p.repetition_penalty) for p in params], np.float32)
    rng = np.zeros((padded_rows, 2), np.uint32)
    rng[:n, 0] = [fold_seed(s) for s in seeds]
    rng[:n, 1] = [s & _U32 for s in steps]
    variant = SamplerVariant(random=any(not p.greedy for p in params),
                             filters=any(p.uses_filters and not p.greedy for p in params),
                             penalties=any(p.uses_penalties for p in params))
    index = value = None
    if variant.penalties:
      if histories is None or len(histories) != n:
        raise ValueError("histories are needed when a row uses penalties")
      index, value = _penalty_arrays(params, histories, padded_rows, vocab_size)
    return SamplingBatch(table, rng, index, value, variant)

  def tensors(self, device: str | None = None) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """(params, rng, penalties) as realized tensors, the arguments of `sample`."""
    pen = None
    if self.penalty_index is not None and self.penalty_value is not None:
      pen = (Tensor(self.penalty_index, device=device), Tensor(self.penalty_value, device=device))
    return Tensor(self.params, device=device), Tensor(self.rng, device=device), pen


def fold_seed(seed: int) -> int:
  """Any Python int (negative, > 32 bits) to a uint32 seed."""
  seed &= (1 << 64) - 1
  return (seed ^ (seed >> 32)) & _U32


def _bucket(n: int) -> int: return max(MIN_PENALTY_LEN, 1 << (max(n, 1) - 1).bit_length())


def _penalty_arrays(params: list[SamplingParams], histories: list[tuple[Sequence[int], Sequence[int]]],
                    padded_rows: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
  for i, p in enumerate(params):
    if not p.uses_penalties:
      continue  # its penalties are no-ops: send nothing
    prompt, output = (np.asarray(h, np.int64).reshape(-1) for h in histories[i])
    out_tokens, out_counts = np.unique(output, return_counts=True)
    seen = np.union1d(prompt, out_tokens)
    counts = np.zeros(len(seen), np.float32)
    counts[np.searchsorted(seen, out_tokens)] = out_counts
    ok = (seen >= 0) & (seen < vocab_size)
    rows[i] = (seen[ok], counts[ok])
  length = _bucket(max(len(s) for s, _ in rows.values()))
  index = np.full((padded_rows, length), -1, np.int32)
  value = np.zeros((padded_rows, length, 2), np.float32)
  for i, (seen, counts) in rows.items():
    index[i, :len(seen)] = i * vocab_size + seen
    value[i, :len(seen), 0], value[i, :len(seen), 1] = counts, 1.0
  return index, value


# ---- device side ----

def _col(params: Tensor, c: int) -> Tensor: return params[:, c:c + 1]  # [B, 1], broadcasts over the vocab


ARGMAX_CHUNK = 256


def argmax_rows(x: Tensor) -> Tensor:
  """x.argmax(1) for [B, V] (the first index of each row's maximum) in two stages: per chunk of ARGMAX_CHUNK, then
  over the chunks. tinygrad's one-stage argmax gives each row a handful of threads; at batch 1 on an H100 its two
  reductions over the 152k vocabulary took 0.23 ms, a sixth of a decode step."""
  b, v = x.shape
  if v <= ARGMAX_CHUNK: return x.argmax(1)
  groups = -(-v // ARGMAX_CHUNK)
  chunks = x.pad(((0, 0), (0, groups * ARGMAX_CHUNK - v)), value=float("-inf")).reshape(b, groups, ARGMAX_CHUNK)
  # realized: else the last line's select would recompute every chunk's argmax for every chunk
  chunk_max, chunk_arg = chunks.max(2).contiguous(), chunks.argmax(2).contiguous()
  best = chunk_max.argmax(1)                                           # the first chunk holding the row's maximum
  inside = (Tensor.arange(groups)[None, :] == best[:, None]).where(chunk_arg, 0).sum(1)
  return best * ARGMAX_CHUNK + inside


def apply_penalties(logits: Tensor, params: Tensor, penalty_index: Tensor, penalty_value: Tensor) -> Tensor:
  """vLLM's penalties: repetition over prompt+output tokens, frequency and presence over output tokens."""
  b, v = logits.shape
  dense = Tensor.zeros(b * v, 2, dtype=dtypes.float32).contiguous()
  dense = scatter_rows(dense, penalty_index.reshape(-1), penalty_value.reshape(-1, 2)).reshape(b, v, 2)
  count, seen = dense[:, :, 0], dense[:, :, 1] > 0
  rep = seen.where(_col(params, REPETITION), 1.0)
  logits = (logits > 0).where(logits / rep, logits * rep)
  return logits - _col(params, FREQUENCY) * count - _col(params, PRESENCE) * (count > 0).float()


def _search_max(pred: Callable[[Tensor], Tensor], rows: int, nbits: int) -> Tensor:
  """Largest t in [0, 2^nbits) per row (uint32 [rows]) with pred(t) true; pred([rows, C] uint32) -> [rows, C] bool
  must be true then false as t grows, and true at 0.

  Each pass decides RADIX_BITS bits by testing all 2^RADIX_BITS - 1 next digits at once, so a 32-bit threshold costs
  ceil(32 / RADIX_BITS) masked reductions over [B, V] (8 with 4 bits) instead of 32 for plain bisection: fewer
  kernels and reads of the logits for a few more compares per element (on a 2-core CPU, compute-bound, 2 bits was
  ~15% faster than 4; on a GPU fewer passes should win).
  """
  t = Tensor.zeros(rows, dtype=dtypes.uint32)
  shift = nbits
  while shift > 0:
    width = min(RADIX_BITS, shift)
    shift -= width
    digits = Tensor.arange(1, 1 << width, dtype=dtypes.uint32) * (1 << shift)
    passed = pred(t[:, None] + digits[None, :])  # t has zeros below bit `shift + width`, so + is |
    t = t + passed.cast(dtypes.uint32).sum(1).cast(dtypes.uint32) * (1 << shift)
  return t


def kth_largest(x: Tensor, k: Tensor) -> Tensor:
  """k-th largest value per row of x [B, V] (k [B] int32 in 1..V): ceil(32 / RADIX_BITS) passes over [B, V]."""
  key = order_key(x).contiguous()
  pred = lambda t: (key[:, None, :] >= t[:, :, None]).sum(2) >= k[:, None]
  return from_order_key(_search_max(pred, x.shape[0], 32))


def top_p_mask(probs: Tensor, top_p: Tensor) -> Tensor:
  """Keep token i iff the mass of tokens strictly more probable than i is < top_p * total (probs [B, V] unnormalised,
  in [0, 1]). Finds the largest t with mass(probs > t) >= top_p * total (probs <= 1.0 have < 2^30 as bits, so
  ceil(30 / RADIX_BITS) passes);
  the kept tokens are exactly those above it. top_p >= 1 keeps everything (float sums would not reach 100%)."""
  probs = probs.contiguous()
  target = (top_p * probs.sum(1))[:, None]
  p3 = probs[:, None, :]
  pred = lambda t: (p3 > t.bitcast(dtypes.float32)[:, :, None]).where(p3, 0.0).sum(2) >= target
  thr = _search_max(pred, probs.shape[0], 30).bitcast(dtypes.float32)
  return (probs > thr[:, None]) | (top_p >= 1.0)[:, None]


def filter_mask(scaled: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
  """Tokens kept by min-p, top-k and then top-p (on the survivors' renormalised probs): bool [B, V].

  scaled [B, V] is logits / temperature; top_k [B] (0 = off, as float or int), top_p [B] (1 = off), min_p [B] (0 = off).
  min-p and top-k are both "keep the largest" filters, so they commute; top-p then sees their intersection, like vLLM.
  """
  v = scaled.shape[1]
  rel = (scaled - scaled.max(1, keepdim=True)).exp()  # prob / max prob
  k = (top_k > 0).where(top_k.minimum(v), v).cast(dtypes.int32)
  keep = (rel >= min_p[:, None]) & (scaled >= kth_largest(scaled, k)[:, None])
  return keep & top_p_mask(keep.where(rel, 0.0), top_p)


def _fmix32(h: Tensor) -> Tensor:
  """murmur3's 32-bit finaliser (full avalanche); tinygrad's uint32 * wraps like C."""
  h = h ^ (h >> 16)
  h = h * 0x85EBCA6B
  h = h ^ (h >> 13)
  h = h * 0xC2B2AE35
  return h ^ (h >> 16)


def uniform_noise(rng: Tensor, vocab_size: int) -> Tensor:
  """u[b, v] in (0, 1) from hash(seed[b], step[b], v) alone: the same for a row whatever else is in the batch."""
  key1 = _fmix32(_fmix32(rng[:, 0] ^ 0x3C6EF372) ^ rng[:, 1])[:, None]
  key2 = _fmix32(key1 ^ 0x9E3779B9)
  tok = Tensor.arange(vocab_size, dtype=dtypes.uint32)[None, :]
  h = _fmix32(_fmix32(tok ^ key1) + key2)
  return ((h >> 8).cast(dtypes.float32) + 0.5) * (1.0 / (1 << 24))  # 24 random bits, never 0 or 1


def acceptance_uniforms(rng: Tensor) -> Tensor:
  """u[b] in (0, 1) from hash(seed[b], step[b]) alone, independent of uniform_noise's (speculative decoding's tests of
  proposals)."""
  h = _fmix32(_fmix32(_fmix32(rng[:, 0] ^ 0x6A09E667) ^ rng[:, 1]) ^ 0xBB67AE85)
  return ((h >> 8).cast(dtypes.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(rng: Tensor, vocab_size: int) -> Tensor:
  """Standard Gumbel noise [B, V] from uniform_noise: argmax(logits + noise) draws from softmax(logits)."""
  return -(-uniform_noise(rng, vocab_size).log()).log()


def shaped_logits(logits: Tensor, params: Tensor, variant: SamplerVariant,
                  penalties: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
  """The logits sampling draws from: penalised, then (random rows) divided by the temperature with the filtered tokens
  at -inf; and the greedy rows [B] (None: every row is greedy, the logits only penalised)."""
  logits = logits.float()
  if variant.penalties:
    if penalties is None:
      raise ValueError("variant.penalties needs the penalty tensors")
    logits = apply_penalties(logits, params, *penalties).contiguous()  # else every consumer recomputes it
  if not variant.random: return logits, None
  temp = params[:, TEMPERATURE]
  is_greedy = temp < GREEDY_EPS
  scaled = logits / is_greedy.where(1.0, temp)[:, None]
  if variant.filters:   # (greedy rows skip them: their argmax survives every filter anyway)
    keep = filter_mask(scaled, params[:, TOP_K], params[:, TOP_P], params[:, MIN_P])
    scaled = (keep | is_greedy[:, None]).where(scaled, float("-inf"))
  return scaled, is_greedy


def sample(logits: Tensor, params: Tensor, rng: Tensor, variant: SamplerVariant,
           penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
  """One token id per row ([B] int32) from logits [B, V], params [B, 7] float32, rng [B, 2] uint32 (seed, step)."""
  scaled, is_greedy = shaped_logits(logits, params, variant, penalties)
  if is_greedy is None: return argmax_rows(scaled).cast(dtypes.int32)
  # greedy rows get no noise, so one argmax serves both kinds of row (a second pass over [B, V] cost 0.4 ms at B=256)
  gumbel = is_greedy[:, None].where(0.0, gumbel_noise(rng, logits.shape[1]))
  return argmax_rows(scaled + gumbel).cast(dtypes.int32)


def target_probs(logits: Tensor, params: Tensor, variant: SamplerVariant,
                 penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
  """[B, V]: the distribution `sample` draws each row's token from (one-hot at the argmax for a greedy row)."""
  scaled, is_greedy = shaped_logits(logits, params, variant, penalties)
  one_hot = (Tensor.arange(scaled.shape[1]).to(scaled.device)[None, :] == argmax_rows(scaled)[:, None]).float()
  return one_hot if is_greedy is None else is_greedy[:, None].where(one_hot, scaled.softmax(1))


def sample_packed(logits: Tensor, params_bits: Tensor, rng_bits: Tensor, variant: SamplerVariant,
                  penalties: tuple[Tensor, Tensor] | None = None) -> Tensor:
  """sample() with params and rng as the int32 bits the step's packed input carries them in (an attention backend's
  `sample` contract: a kernel takes those slices as they are)."""
  return sample(logits, params_bits.bitcast(dtypes.float32), rng_bits.bitcast(dtypes.uint32), variant, penalties)


def compute_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
  """From the raw logits (vLLM's default): logprob of token_ids [B], top-k ids [B, k] int32 and logprobs [B, k] (by
  layers/top_k.py: always k distinct ids, ties and -inf included)."""
  b, v = logits.shape
  lp = logits.float().log_softmax(1).contiguous()
  vocab = Tensor.arange(v, dtype=dtypes.int32)[None, :]
  chosen = (vocab == token_ids.reshape(b, 1).cast(dtypes.int32)).where(lp, 0.0).sum(1)
  values, ids = top_k(lp, k)
  return chosen, ids, values
