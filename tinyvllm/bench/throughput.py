"""Offline throughput on nano-vllm's workload: 256 requests, prompt and output lengths uniform in [100, 1024], prompt
ids uniform in [0, 10000), seed 0, ignore EOS, temperature 0.6; one warm-up run, then one timed `generate`."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tinyvllm.engine.llm import LLM
from tinyvllm.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
  requests: int
  output_tokens: int
  prompt_tokens: int
  seconds: float

  @property
  def output_tok_s(self) -> float: return self.output_tokens / self.seconds

  def line(self) -> str:
    return (f"throughput: {self.requests} requests, {self.prompt_tokens} prompt + {self.output_tokens} output tokens in "
            f"{self.seconds:.2f} s: {self.output_tok_s:.0f} output tok/s")


def workload(num_requests: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, vocab, int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(num_requests)]
  outputs = [int(n) for n in rng.integers(min_len, max_len + 1, num_requests)]
  params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, seed=i) for i, n in enumerate(outputs)]
  return prompts, params


def run_throughput(llm: LLM, num_requests: int = 256, min_len: int = 100, max_len: int = 1024, warmup_requests: int = 256
                   ) -> ThroughputResult:
  """The warm-up runs the first `warmup_requests` requests of a workload with another seed (no prefix-cache hits)."""
  vocab = min(10000, llm.engine.model_config.vocab_size)
  if warmup_requests:
    prompts, params = workload(num_requests, min_len, max_len, vocab, seed=1)
    llm.generate(prompts[:warmup_requests], params[:warmup_requests], use_tqdm=False)
  prompts, params = workload(num_requests, min_len, max_len, vocab)
  start = time.perf_counter()
  outputs = llm.generate(prompts, params, use_tqdm=False)
  seconds = time.perf_counter() - start
  return ThroughputResult(num_requests, sum(len(o.outputs[0].token_ids) for o in outputs), sum(map(len, prompts)), seconds)
