"""Decode tok/s vs context length at a given batch size.

The contexts are filled without computing them: the benchmark gives each sequence the blocks of a context of the wanted
length and marks it computed (the cache holds whatever it held), so that only decode steps are timed and no time goes
to prefilling batch x context tokens. Attention reads the same number of bytes whatever the cache holds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tinyvllm.engine.llm import LLM
from tinyvllm.sampling_params import SamplingParams


@dataclass
class ContextResult:
  batch: int
  context: int
  steps: int
  seconds: float

  @property
  def tok_s(self) -> float: return self.batch * self.steps / self.seconds

  @property
  def step_ms(self) -> float: return self.seconds / self.steps * 1e3

  def line(self) -> str:
    return f"decode batch {self.batch:>4} at context {self.context:>6}: {self.tok_s:9.1f} tok/s ({self.step_ms:.2f} ms/step)"


def _fill_contexts(llm: LLM, batch: int, context: int, steps: int, seed: int) -> None:
  engine, rng = llm.engine, np.random.default_rng(seed)
  vocab = min(10000, engine.model_config.vocab_size)
  for i in range(batch):
    engine.add_request(f"ctx-{seed}-{i}", rng.integers(0, vocab, context).tolist(),
                       SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
  scheduler = engine.scheduler
  for seq in list(scheduler.waiting):
    scheduler._admit(seq)
    engine.allocator.append_slots(seq, seq.num_tokens - 1)
    seq.num_computed_tokens = seq.num_tokens - 1   # pretend the prompt (but its last token) is in the cache


def decode_at_context(llm: LLM, batch: int, context: int, steps: int = 32, seed: int = 0) -> ContextResult:
  engine = llm.engine
  _fill_contexts(llm, batch, context, steps, seed)
  engine.step()                          # the last prompt token of each sequence + the first sample
  engine.step()
  start = time.perf_counter()
  for _ in range(steps - 2): engine.step()
  seconds = time.perf_counter() - start
  while engine.has_unfinished_requests(): engine.step()
  return ContextResult(batch, context, steps - 2, seconds)


def run_context_sweep(llm: LLM, batch: int, contexts: list[int], steps: int = 32) -> list[ContextResult]:
  results = []
  for i, context in enumerate(contexts):
    decode_at_context(llm, batch, context, steps, seed=2 * i)           # warm-up: captures this context's layouts
    results.append(decode_at_context(llm, batch, context, steps, seed=2 * i + 1))
    print(results[-1].line(), flush=True)
  return results
