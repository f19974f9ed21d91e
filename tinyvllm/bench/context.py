"""Decode tok/s vs context length at a given batch size.

Each context is run twice with the same prompts: the first run prefills them for real (and captures the step layouts),
the second finds every full block of its prompts in the prefix cache, so that its timed steps are decode steps over
contexts of the wanted length. The engine needs prefix caching on, and a cache that holds the batch's contexts.
"""
from __future__ import annotations

import gc
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


def _add_requests(llm: LLM, batch: int, context: int, steps: int, seed: int, tag: str) -> None:
  engine, rng = llm.engine, np.random.default_rng(seed)
  vocab = min(10000, engine.model_config.vocab_size)
  for i in range(batch):
    engine.add_request(f"ctx-{tag}-{seed}-{i}", rng.integers(0, vocab, context).tolist(),
                       SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))


def decode_at_context(llm: LLM, batch: int, context: int, steps: int = 32, seed: int = 0, tag: str = "run") -> ContextResult:
  """`steps` decode steps of `batch` sequences at `context` tokens; the first two (the last prompt tokens and the first
  samples) are not timed."""
  engine = llm.engine
  _add_requests(llm, batch, context, steps, seed, tag)
  engine.step()
  engine.step()
  gc.collect()   # the earlier runs' garbage, collected now rather than in a pause inside the timed steps
  start = time.perf_counter()
  for _ in range(steps - 2): engine.step()
  seconds = time.perf_counter() - start
  while engine.has_unfinished_requests(): engine.step()
  return ContextResult(batch, context, steps - 2, seconds)


def run_context_sweep(llm: LLM, batch: int, contexts: list[int], steps: int = 32) -> list[ContextResult]:
  if not getattr(llm.engine.allocator, "enable_prefix_caching", False):
    raise ValueError("the context sweep needs prefix caching (its timed runs find their prompts in the cache)")
  results = []
  for i, context in enumerate(contexts):
    decode_at_context(llm, batch, context, steps, seed=i, tag="prefill")   # computes the prompts, captures the layouts
    results.append(decode_at_context(llm, batch, context, steps, seed=i, tag="cached"))
    print(results[-1].line(), flush=True)
  return results
