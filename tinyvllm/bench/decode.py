"""Decode speed: tok/s of the decode phase with the KV cache, and (to show what the cache buys) without it: every token
then comes from a full prefill of the sequence so far, as a fresh request. With speculative decoding the line adds the
proposals, the acceptance rate and the tokens each verification emitted; `repeated_prompts` are prompts whose text the
model is about to repeat (where n-gram proposals pay)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.messages import SpecDecodingStats
from tinyvllm.sampling_params import SamplingParams

NO_KV_CACHE = "no kv cache"


@dataclass
class DecodeResult:
  mode: str
  batch_size: int
  prompt_len: int
  new_tokens: int
  prefill_s: float
  decode_s: float
  token_ids: list[list[int]]
  step_s: list[float] = field(default_factory=list)   # each decode step's wall time, where it was taken one by one
  spec: SpecDecodingStats | None = None   # speculative decoding's counts over the run

  @property
  def decode_tok_s(self) -> float: return self.batch_size * (self.new_tokens - 1) / self.decode_s

  @property
  def median_step_ms(self) -> float: return float(np.median(self.step_s)) * 1e3 if self.step_s else float("nan")

  @property
  def slow_steps(self) -> int:
    """Steps over twice the median: a pause (garbage collection, another process) rather than a slower GPU step."""
    return sum(t > 2 * self.median_step_ms / 1e3 for t in self.step_s)

  def line(self) -> str:
    what = ", each step a full prefill of the sequence so far as a fresh request" if self.mode == NO_KV_CACHE else ""
    spec = self.spec
    speculation = "" if spec is None else (
      f"; speculative: {spec.num_draft_tokens} proposed, {spec.num_accepted_tokens} accepted ({spec.acceptance_rate:.0%}), "
      f"{spec.num_drafts} verifications emitting {spec.mean_acceptance_length:.2f} tokens each")
    return (f"{self.mode:>14}: batch {self.batch_size}, prompt {self.prompt_len}, {self.new_tokens} new tokens: "
            f"prefill {self.prefill_s * 1e3:.1f} ms, decode {self.decode_tok_s:.1f} tok/s "
            f"({self.decode_s / (self.new_tokens - 1) * 1e3:.2f} ms per token{what}{self._steps()}){speculation}")

  def _steps(self) -> str:
    """The median step and the pauses, where steps were timed: a mean moved by a few paused steps shows in them."""
    return f"; median step {self.median_step_ms:.3f} ms, {self.slow_steps} slow" if self.step_s else ""


def random_prompts(engine: LLMEngine, batch: int, length: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return rng.integers(0, min(engine.model_config.vocab_size, 10000), size=(batch, length)).tolist()


def repeated_prompts(engine: LLMEngine, batch: int, length: int, seed: int = 0) -> list[list[int]]:
  """Prompts that repeat a text: a document d (the model's own greedy text from its BOS token, or from a random token),
  then d again from its start, cut after j tokens (j differs per prompt): d[:length - j] + d[:j]. The model is then
  about to say again what the prompt already holds, as when quoting or editing a document."""
  rng = np.random.default_rng(seed)
  bos = engine.model_config.bos_token_id
  start = [bos] if bos is not None else random_prompts(engine, 1, 1, seed)[0]
  engine.add_request("repeat-doc", start, SamplingParams(temperature=0, max_tokens=max(1, length - 1), ignore_eos=True))
  doc: list[int] = []
  while engine.has_unfinished_requests():
    for out in engine.step(): doc = start + out.outputs[0].token_ids
  cuts = rng.integers(1, max(2, length // 4), batch)
  return [doc[:length - int(j)] + doc[:int(j)] for j in cuts]


def _spec_counts(engine: LLMEngine) -> SpecDecodingStats | None:
  return engine.core.stats().spec_decoding


def with_kv_cache(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> DecodeResult:
  params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
  before = _spec_counts(engine)
  ids = [f"bench-{i}" for i in range(len(prompts))]
  for rid, prompt in zip(ids, prompts, strict=True): engine.add_request(rid, prompt, params)
  finals = {}
  t0 = time.perf_counter()
  while not finals and engine.has_unfinished_requests():   # until the prompt step's tokens are read (a step later, async)
    for out in engine.step(): finals[out.request_id] = out
  t1 = last = time.perf_counter()
  steps = []
  while engine.has_unfinished_requests():
    for out in engine.step(): finals[out.request_id] = out
    now = time.perf_counter()
    steps.append(now - last)
    last = now
  tokens = [finals[rid].outputs[0].token_ids for rid in ids]
  after = _spec_counts(engine)
  spec = None if before is None or after is None else after.since(before)
  return DecodeResult("kv cache", len(prompts), len(prompts[0]), new_tokens, t1 - t0, last - t1, tokens, steps, spec)


def without_kv_cache(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> DecodeResult:
  """Every step recomputes each whole sequence from scratch (a fresh one-token request over prompt + output so far,
  the prefix cache emptied first): what decoding costs with no cache."""
  params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
  outputs: list[list[int]] = [[] for _ in prompts]
  times = []
  for step in range(new_tokens):
    t = time.perf_counter()
    engine.reset_prefix_cache()
    ids = [f"nocache-{step}-{i}" for i in range(len(prompts))]
    for rid, prompt, out in zip(ids, prompts, outputs, strict=True): engine.add_request(rid, prompt + out, params)
    finals = {}
    while engine.has_unfinished_requests():
      for result in engine.step(): finals[result.request_id] = result
    for rid, out in zip(ids, outputs, strict=True): out += finals[rid].outputs[0].token_ids
    times.append(time.perf_counter() - t)
  return DecodeResult(NO_KV_CACHE, len(prompts), len(prompts[0]), new_tokens, times[0], sum(times[1:]), outputs)


def run_decode_bench(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, no_kv_cache: bool,
                     warmup: bool = True, repeated: bool = False) -> list[DecodeResult]:
  """Each mode runs twice and reports the second run, so that JIT captures of every shape are warm. The prefix cache
  is emptied before each run: a hit on the warm-up's blocks would skip the prefill. `repeated`: repeated_prompts
  rather than random tokens. new_tokens >= 2: the first token comes from the prefill, the decode phase makes the rest."""
  if batch < 1 or prompt_len < 1: raise ValueError(f"batch ({batch}) and prompt_len ({prompt_len}) must be >= 1")
  if new_tokens < 2: raise ValueError(f"new_tokens must be >= 2 for a decode measurement, got {new_tokens}")
  prompts = repeated_prompts(engine, batch, prompt_len) if repeated else random_prompts(engine, batch, prompt_len)
  modes = [with_kv_cache] + ([without_kv_cache] if no_kv_cache else [])
  results = []
  for mode in modes:
    for run in range(2 if warmup else 1):
      engine.reset_prefix_cache()
      result = mode(engine, prompts, new_tokens)
      if run == 1 or not warmup: results.append(result)
  return results
