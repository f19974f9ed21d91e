"""ModelRunner: a scheduled batch in, one sampled token per finishing sequence out.

Each step's metadata (tokens, positions, slot mapping, block tables, query layout, sampling settings) is packed on the
host into one int32 array and copied to the device once. The forward pass plus sampling runs under a TinyJit capture
per layout (the bucketed shapes of the step), so a replay costs one copy in, the captured kernels and one copy out of
the sampled ids.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes

from tinyvllm.core.scheduler_output import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.layers.attention import AttentionMetadata
from tinyvllm.layers.sampler import NUM_PARAMS, SamplerVariant, SamplingBatch, compute_logprobs, sample
from tinyvllm.model.llama import StepInputs, TransformerLM
from tinyvllm.worker.input_batch import HostBatch, prepare_batch
from tinyvllm.worker.kv_cache import KVCache

USE_JIT = os.environ.get("TINYVLLM_JIT", "1") != "0"


@dataclass(frozen=True)
class StepLayout:
  """The static shape of one step; each distinct layout gets its own JIT capture."""
  tokens: int          # N
  seqs: int            # S
  query_len: int       # Tq
  max_blocks: int
  rows: int            # R sampled rows
  context_len: int     # L
  penalty_len: int     # 0 when no row uses penalties
  variant: SamplerVariant
  logprobs: int        # top-k logprobs to return per row; -1: none at all

  def split(self) -> list[tuple[str, int]]:
    """(name, int32 count) of each packed field, in order."""
    n, s, r = self.tokens, self.seqs, self.rows
    return [("token_ids", n), ("positions", n), ("slot_mapping", n), ("output_index", n), ("logits_index", r),
            ("block_tables", s * self.max_blocks), ("query_index", s * self.query_len), ("query_pos", s * self.query_len),
            ("params", r * NUM_PARAMS), ("rng", r * 2), ("penalty_index", r * self.penalty_len),
            ("penalty_value", r * self.penalty_len * 2)]


def pack(host: HostBatch, sampling: SamplingBatch) -> np.ndarray:
  parts = [host.token_ids, host.positions, host.slot_mapping, host.output_index, host.logits_index, host.block_tables,
           host.query_index, host.query_pos, sampling.params.view(np.int32), sampling.rng.view(np.int32)]
  if sampling.penalty_index is not None and sampling.penalty_value is not None:
    parts += [sampling.penalty_index, sampling.penalty_value.view(np.int32)]
  return np.concatenate([np.ascontiguousarray(p).reshape(-1) for p in parts])


@dataclass
class TokenLogprobs:
  """Per sampled row: the sampled token's logprob and rank, and the top-k alternatives (from the raw logits)."""
  logprob: np.ndarray        # [R] float32
  rank: np.ndarray           # [R] int32
  top_ids: np.ndarray        # [R, k] int32
  top_logprobs: np.ndarray   # [R, k] float32


@dataclass
class StepResult:
  seqs: list[Sequence]       # each sampled sequence (a fork appears here before it joins the running set)
  token_ids: list[int]
  logprobs: TokenLogprobs | None = None


LOGPROB_BUCKETS = (0, 1, 2, 5, 10, 20)


def logprobs_bucket(seqs: list[Sequence]) -> int:
  wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
  return -1 if not wanted else next(b for b in LOGPROB_BUCKETS if b >= max(wanted))


class ModelRunner:
  def __init__(self, model: TransformerLM, kv_cache: KVCache):
    self.model, self.kv_cache = model, kv_cache
    self.vocab_size = model.config.vocab_size
    self._captures: dict[StepLayout, TinyJit] = {}

  def execute(self, sched: SchedulerOutput) -> StepResult:
    if sched.block_copies: self.kv_cache.copy_blocks(sched.block_copies)
    host = prepare_batch(sched.scheduled, self.kv_cache.block_size)
    sampling = self._sampling_batch(host)
    layout = StepLayout(len(host.token_ids), host.block_tables.shape[0], host.query_index.shape[1],
                        host.block_tables.shape[1], len(host.logits_index), host.context_len,
                        0 if sampling.penalty_index is None else sampling.penalty_index.shape[1], sampling.variant,
                        logprobs_bucket(host.sample_seqs))
    packed = Tensor(pack(host, sampling), device=self.model.device).realize()
    out = self._step_fn(layout)(packed)
    rows = len(host.sample_seqs)
    if layout.logprobs < 0: return StepResult(host.sample_seqs, out.numpy()[:rows].tolist())
    tokens, chosen, rank, top_ids, top_lps = (t.numpy()[:rows] for t in out)
    return StepResult(host.sample_seqs, tokens.tolist(), TokenLogprobs(chosen, rank, top_ids, top_lps))

  def logits(self, sched: SchedulerOutput) -> np.ndarray:
    """Float32 logits of each sampling row, without sampling (eager; for scoring and checks, not the hot path)."""
    host = prepare_batch(sched.scheduled, self.kv_cache.block_size)
    meta = AttentionMetadata(*(Tensor(a) for a in (host.slot_mapping, host.block_tables, host.query_index, host.query_pos,
                                                   host.output_index)), self.kv_cache.block_size, host.context_len)
    inputs = StepInputs(Tensor(host.token_ids), Tensor(host.positions), meta, Tensor(host.logits_index))
    logits, caches = self.model(inputs, self.kv_cache.layers)
    Tensor.realize(logits, *[t for pair in caches for t in pair])
    return logits.numpy()[:len(host.sample_seqs)]

  def _step_fn(self, layout: StepLayout):
    if not USE_JIT: return lambda packed: self._forward(layout, packed)
    if layout not in self._captures: self._captures[layout] = TinyJit(lambda packed: self._forward(layout, packed))
    return self._captures[layout]

  def _forward(self, layout: StepLayout, packed: Tensor) -> Tensor:
    f, offset = {}, 0
    for name, count in layout.split():
      f[name], offset = packed[offset:offset + count], offset + count
    s = layout.seqs
    meta = AttentionMetadata(f["slot_mapping"], f["block_tables"].reshape(s, layout.max_blocks),
                             f["query_index"].reshape(s, layout.query_len), f["query_pos"].reshape(s, layout.query_len),
                             f["output_index"], self.kv_cache.block_size, layout.context_len)
    inputs = StepInputs(f["token_ids"], f["positions"], meta, f["logits_index"])
    logits, caches = self.model(inputs, self.kv_cache.layers)
    r = layout.rows
    penalties = None
    if layout.penalty_len:
      penalties = (f["penalty_index"].reshape(r, layout.penalty_len),
                   f["penalty_value"].bitcast(dtypes.float32).reshape(r, layout.penalty_len, 2))
    tokens = sample(logits, f["params"].bitcast(dtypes.float32).reshape(r, NUM_PARAMS),
                    f["rng"].bitcast(dtypes.uint32).reshape(r, 2), layout.variant, penalties)
    outputs: tuple[Tensor, ...] = (tokens,)
    if layout.logprobs >= 0:
      chosen, top_ids, top_lps = compute_logprobs(logits, tokens, layout.logprobs)
      rank = (logits.float().log_softmax(1) > chosen[:, None]).sum(1).cast(dtypes.int32) + 1
      outputs = (tokens, chosen, rank, top_ids, top_lps)
    Tensor.realize(*outputs, *[t for pair in caches for t in pair])
    return outputs[0] if len(outputs) == 1 else outputs

  def _sampling_batch(self, host: HostBatch) -> SamplingBatch:
    seqs = host.sample_seqs
    histories = [(s.prompt_token_ids, s.output_token_ids) for s in seqs] if any(s.params.uses_penalties for s in seqs) else None
    return SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], [len(s.output_token_ids) for s in seqs],
                               histories, len(host.logits_index), self.vocab_size)
