"""Speculative decoding's verification: which of k proposed tokens a sequence keeps, and the token that follows them,
so that every emitted token has exactly the target model's distribution (Leviathan et al., 2023; vLLM's
RejectionSampler).

For each sequence the target's probabilities p_0 .. p_k come from one forward pass over its last token and the k
proposals x_0 .. x_{k-1} (p_i the distribution after x_{i-1}, already shaped by temperature, penalties and the top-k /
top-p / min-p filters). Proposal i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), q_i the proposer's
distribution (a draft model's), or p_i(x_i) for a deterministic proposal (n-gram lookup: q_i is one-hot). At the first
rejection the token is drawn from the residual max(p_i - q_i, 0), renormalised; when all k are accepted a bonus token
is drawn from p_k. A greedy row's p is one-hot at its argmax, which makes this "keep proposals while they equal the
target's argmax, then emit the argmax": the output is the one plain greedy decoding gives.

Randomness arrives as tensors (uniforms for the acceptance tests, Gumbel noise for the draws), so the caller decides
how a row's draws are seeded. Everything is tinygrad ops with static shapes [S, k (+ 1), V].
"""
from __future__ import annotations

from tinygrad import Tensor, dtypes

from tinyvllm.backend.sampling import SamplerVariant
from tinyvllm.layers.sampler import acceptance_uniforms, argmax_rows, gumbel_noise, target_probs


def rejection_sample(target_probs: Tensor, draft_tokens: Tensor, uniforms: Tensor, gumbel: Tensor,
                     draft_probs: Tensor | None = None) -> tuple[Tensor, Tensor]:
  """(tokens [S, k + 1] int32, emitted [S] int32): row s emits tokens[s, :emitted[s]] (accepted proposals, then the
  residual's or the bonus draw); the rest of the row is -1.

  target_probs [S, k + 1, V]; draft_tokens [S, k] int32; uniforms [S, k] in [0, 1); gumbel [S, k + 1, V] standard
  Gumbel noise; draft_probs [S, k, V] (None: deterministic proposals)."""
  s, k1, vocab = target_probs.shape
  k = k1 - 1
  if draft_tokens.shape != (s, k) or uniforms.shape != (s, k) or gumbel.shape != (s, k1, vocab):
    raise ValueError(f"rejection_sample: target_probs {target_probs.shape}, draft_tokens {draft_tokens.shape}, uniforms "
                     f"{uniforms.shape}, gumbel {gumbel.shape} do not agree")
  if draft_probs is not None and draft_probs.shape != (s, k, vocab):
    raise ValueError(f"rejection_sample: draft_probs {draft_probs.shape}, expected {(s, k, vocab)}")
  one_hot = draft_tokens.unsqueeze(-1) == Tensor.arange(vocab).to(target_probs.device).reshape(1, 1, vocab)
  q = one_hot.float() if draft_probs is None else draft_probs.float()
  p = target_probs.float()
  p_x, q_x = (p[:, :k] * one_hot).sum(-1), (q * one_hot).sum(-1)
  # u < p(x) / q(x) without the division (a proposal its own proposer gave no mass is never accepted)
  accepted = (p_x > uniforms * q_x) & (q_x > 0)
  # the first rejected position (k: none), as the count of leading acceptances
  leading = accepted.int().cumprod(axis=1).sum(axis=1) if k else Tensor.zeros(s, dtype=dtypes.int32, device=p.device)
  # the draw at each position: the residual's at proposals, p_k's for the bonus
  residual = (p[:, :k] - q).maximum(0) if k else p[:, :0]
  weights = residual.cat(p[:, k:], dim=1)
  draws = _argmax_last(weights.log() + gumbel)   # (log 0 = -inf: never drawn)
  # a residual with no mass (p = q at a rejection can only happen with probability 0) falls back to p's own draw
  draws = (weights.sum(-1) > 0).where(draws, _argmax_last(p.log() + gumbel))
  position = Tensor.arange(k1).to(p.device).reshape(1, k1)
  lead = leading.reshape(s, 1)
  proposals = draft_tokens.cast(dtypes.int32).pad(((0, 0), (0, 1)), value=-1)
  tokens = (position < lead).where(proposals, (position == lead).where(draws, -1))
  return tokens.cast(dtypes.int32), (leading + 1).cast(dtypes.int32)


def _argmax_last(x: Tensor) -> Tensor:
  """argmax over the last axis of [S, k + 1, V], int32, through the sampler's two-stage argmax: tinygrad's own, fused
  into the selects around it, recomputed each row's maximum per element (a V x V loop that took seconds to compile)."""
  s, k1, vocab = x.shape
  return argmax_rows(x.reshape(s * k1, vocab).contiguous()).reshape(s, k1).cast(dtypes.int32)


def verify(logits: Tensor, params: Tensor, rng: Tensor, variant: SamplerVariant, draft_tokens: Tensor,
           penalties: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
  """A verification step's tokens: logits [S * (k + 1), V] of each sequence's last token and proposals (row
  s * (k + 1) + j: the distribution after proposal j - 1), their rows' sampling settings and seeds (params, rng as
  `sample` takes them; row j's step is the index of the token it draws), draft_tokens [S, k] (-1: no proposal there,
  so a sequence with fewer draws its next token from p at its first -1). Returns rejection_sample's (tokens, emitted).

  Proposals are deterministic (n-gram lookup, a draft model's argmax). For steps with a sampled row: an all-greedy step
  is greedy_verify over each row's argmax (the runner takes it from the backend's sampler)."""
  s, k = draft_tokens.shape
  if logits.shape[0] != s * (k + 1): raise ValueError(f"verify: {logits.shape[0]} logits rows for {s} sequences of {k} proposals")
  if not variant.random: raise ValueError("verify: an all-greedy step is greedy_verify over each row's argmax")
  vocab = logits.shape[1]
  probs = target_probs(logits, params, variant, penalties).reshape(s, k + 1, vocab)
  uniforms = acceptance_uniforms(rng).reshape(s, k + 1)[:, :k]
  return rejection_sample(probs, draft_tokens, uniforms, gumbel_noise(rng, vocab).reshape(s, k + 1, vocab))


def greedy_verify(target: Tensor, draft_tokens: Tensor) -> tuple[Tensor, Tensor]:
  """rejection_sample for one-hot target distributions, from their argmax tokens target [S, k + 1]."""
  s, k1 = target.shape
  leading = (draft_tokens == target[:, :k1 - 1]).int().cumprod(axis=1).sum(axis=1) if k1 > 1 else Tensor.zeros(s, dtype=dtypes.int32)
  position, lead = Tensor.arange(k1).to(target.device).reshape(1, k1), leading.reshape(s, 1)
  proposals = draft_tokens.cast(dtypes.int32).pad(((0, 0), (0, 1)), value=-1)
  tokens = (position < lead).where(proposals, (position == lead).where(target, -1))
  return tokens.cast(dtypes.int32), (leading + 1).cast(dtypes.int32)
