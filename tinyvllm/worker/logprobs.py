"""Logprobs a step returns: the sampled tokens' (SamplingParams.logprobs) and the prompt tokens' (prompt_logprobs).

Prompt logprobs are vLLM's: for each prompt token after the first, the logprob of that token given the tokens before
it, its rank and the top-k alternatives, all from the raw logits. They come from the forward pass that computes the
prompt (as vLLM's do): a step holding a prompt chunk of a sequence that asked for them also takes the logits of every
position p of the chunk before the prompt's last and scores prompt token p + 1 with them (the prompt's last position
is the row that samples). A chunk computed again after a preemption scores its tokens again; the output processor keeps
the first scores of each token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor, dtypes

from tinyvllm.core.scheduler_output import ScheduledSequence
from tinyvllm.core.sequence import Sequence
from tinyvllm.layers.sampler import compute_logprobs
from tinyvllm.worker.input_batch import bucket

LOGPROB_BUCKETS = (0, 1, 2, 5, 10, 20)   # top-k sizes compiled (a step's largest k, rounded up)


def top_k_bucket(wanted: list[int]) -> int:
  """The top-k a step computes for these requests' k (-1: none asked)."""
  return -1 if not wanted else next(b for b in LOGPROB_BUCKETS if b >= max(wanted))


@dataclass
class TokenLogprobs:
  """Per scored row: the token's logprob and rank, and the top-k alternatives (from the raw logits)."""
  logprob: np.ndarray        # [R] float32
  rank: np.ndarray           # [R] int32
  top_ids: np.ndarray        # [R, k] int32
  top_logprobs: np.ndarray   # [R, k] float32

  def rows(self, start: int, end: int) -> TokenLogprobs:
    return TokenLogprobs(self.logprob[start:end], self.rank[start:end], self.top_ids[start:end], self.top_logprobs[start:end])


def score(logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """Each row's token: its logprob, its rank (1 = the most probable; ties count for it), the top-k ids and logprobs."""
  chosen, top_ids, top_lps = compute_logprobs(logits, token_ids, k)
  rank = (logits.float().log_softmax(1) > chosen[:, None]).sum(1).cast(dtypes.int32) + 1
  return chosen, rank, top_ids, top_lps


@dataclass
class PromptChunk:
  """The prompt tokens a step scores for one sequence: `count` of them from prompt index `first` (>= 1) on."""
  seq: Sequence
  first: int
  count: int


@dataclass
class PromptRows:
  """A step's prompt-logprob rows, padded to a bucket: the flat token whose logits score each, and the token scored."""
  chunks: list[PromptChunk]
  index: np.ndarray    # [Q] int32
  target: np.ndarray   # [Q] int32
  k: int               # top-k computed (a bucket of the largest prompt_logprobs)

  @property
  def num_rows(self) -> int: return sum(c.count for c in self.chunks)


def prompt_rows(scheduled: list[ScheduledSequence], query_start: np.ndarray) -> PromptRows | None:
  """The rows of this step's prompt chunks that score a prompt token, or None (the step needs no prompt logprobs)."""
  chunks, index, target = [], [], []
  for row, item in enumerate(scheduled):
    if item.seq.params.prompt_logprobs is None: continue
    prompt = item.seq.prompt_token_ids
    end = min(item.start + item.num_new_tokens, len(prompt) - 1)   # positions scoring the next prompt token
    if end <= item.start: continue
    chunks.append(PromptChunk(item.seq, item.start + 1, end - item.start))
    index.extend(range(int(query_start[row]), int(query_start[row]) + end - item.start))
    target.extend(prompt[item.start + 1:end + 1])
  if not chunks: return None
  padded = np.zeros((2, bucket(len(index))), np.int32)
  padded[0, :len(index)], padded[1, :len(target)] = index, target
  return PromptRows(chunks, padded[0], padded[1], top_k_bucket([c.seq.params.prompt_logprobs or 0 for c in chunks]))


@dataclass
class ScoredPromptChunk:
  """A step's prompt logprobs for one sequence: prompt tokens first .. first + len(token_ids) - 1."""
  seq: Sequence
  first: int
  token_ids: list[int]
  logprobs: TokenLogprobs


def split_chunks(rows: PromptRows, scored: TokenLogprobs) -> list[ScoredPromptChunk]:
  """The step's downloaded prompt scores, per sequence."""
  out, offset = [], 0
  for c in rows.chunks:
    out.append(ScoredPromptChunk(c.seq, c.first, rows.target[offset:offset + c.count].tolist(), scored.rows(offset, offset + c.count)))
    offset += c.count
  return out
