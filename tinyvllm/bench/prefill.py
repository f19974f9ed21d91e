"""Prefill latency and peak memory vs prompt length: one prompt computed in one step, by the attention backend in use
(the fused tiled kernel, or the portable path that materialises every query's scores against every key)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tinyvllm.engine.llm import LLM
from tinyvllm.platform.tinygrad_compat import track_peak_memory
from tinyvllm.sampling_params import SamplingParams


@dataclass
class PrefillResult:
  prompt_len: int
  seconds: float
  peak_extra_bytes: int     # device memory above the weights and KV cache at the peak of the step (its three runs)

  def line(self) -> str:
    return (f"prefill {self.prompt_len:>6} tokens: {self.seconds * 1e3:9.1f} ms ({self.prompt_len / self.seconds:8.0f} tok/s), "
            f"peak extra memory {self.peak_extra_bytes / 2**20:9.1f} MiB")


def prefill_once(llm: LLM, length: int, seed: int) -> tuple[float, int]:
  prompt = np.random.default_rng(seed).integers(0, min(10000, llm.engine.model_config.vocab_size), length).tolist()
  engine = llm.engine
  engine.add_request(f"prefill-{seed}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
  with track_peak_memory() as peak:
    start = time.perf_counter()
    while engine.has_unfinished_requests(): engine.step()
    seconds = time.perf_counter() - start
  return seconds, peak.extra_bytes


def run_prefill_sweep(llm: LLM, lengths: list[int]) -> list[PrefillResult]:
  """Each length three times (the first compiles its kernels, the second captures the step when prefill steps are
  JIT-captured); the third's time is reported, and the peak memory of all three (a captured step allocates its
  buffers when it is captured, and a replay allocates nothing). Needs max_num_batched_tokens >= max(lengths) and
  prefix caching off, so that each prompt is one step."""
  results = []
  for i, length in enumerate(lengths):
    runs = [prefill_once(llm, length, seed=3 * i + r) for r in range(3)]
    results.append(PrefillResult(length, runs[-1][0], max(extra for _, extra in runs)))
    print(results[-1].line(), flush=True)
  return results
