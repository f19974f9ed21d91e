"""Decode speed: tok/s of the decode phase with the KV cache, and (to show what the cache buys) without it."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tinyvllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sampling_params import SamplingParams


@dataclass
class DecodeResult:
  mode: str
  batch_size: int
  prompt_len: int
  new_tokens: int
  prefill_s: float
  decode_s: float

  @property
  def decode_tok_s(self) -> float: return self.batch_size * (self.new_tokens - 1) / self.decode_s

  def line(self) -> str:
    return (f"{self.mode:>14}: batch {self.batch_size}, prompt {self.prompt_len}, {self.new_tokens} new tokens: "
            f"prefill {self.prefill_s * 1e3:.1f} ms, decode {self.decode_tok_s:.1f} tok/s "
            f"({self.decode_s / (self.new_tokens - 1) * 1e3:.2f} ms/step)")


def random_prompts(engine: LLMEngine, batch: int, length: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return rng.integers(0, min(engine.model_config.vocab_size, 10000), size=(batch, length)).tolist()


def with_kv_cache(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> DecodeResult:
  params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
  for i, prompt in enumerate(prompts): engine.add_request(f"bench-{i}", prompt, params)
  t0 = time.perf_counter()
  engine.step()
  t1 = time.perf_counter()
  while engine.has_unfinished_requests(): engine.step()
  return DecodeResult("kv cache", len(prompts), len(prompts[0]), new_tokens, t1 - t0, time.perf_counter() - t1)


def without_kv_cache(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> DecodeResult:
  """Every step recomputes the whole sequence from scratch: what decoding costs with no cache."""
  params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
  seqs = [Sequence(f"nocache-{i}", p, params, seed=0, status=SequenceStatus.RUNNING) for i, p in enumerate(prompts)]
  allocator = engine.scheduler.allocator
  for seq in seqs: allocator.allocate(seq)
  times = []
  try:
    for _ in range(new_tokens):
      t = time.perf_counter()
      for seq in seqs: seq.num_computed_tokens = 0
      result = engine.runner.execute(SchedulerOutput([ScheduledSequence(s, s.num_tokens) for s in seqs]))
      for row, token in zip(result.seq_rows, result.token_ids): seqs[row].output_token_ids.append(token)
      times.append(time.perf_counter() - t)
  finally:
    for seq in seqs: allocator.free(seq)
  return DecodeResult("no kv cache", len(prompts), len(prompts[0]), new_tokens, times[0], sum(times[1:]))


def run_decode_bench(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, no_kv_cache: bool,
                     warmup: bool = True) -> list[DecodeResult]:
  prompts = random_prompts(engine, batch, prompt_len)
  if warmup: with_kv_cache(engine, prompts, min(new_tokens, 4))
  results = [with_kv_cache(engine, prompts, new_tokens)]
  if no_kv_cache: results.append(without_kv_cache(engine, prompts, new_tokens))
  return results
