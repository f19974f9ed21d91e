"""Offline throughput (`bench throughput`, as vLLM's `vllm bench throughput`): a seeded mix of requests with random
prompt token ids and lengths, run through one `LLM.generate` in this process after untimed warm-up runs.

Every request ignores EOS, so it produces exactly its drawn number of tokens. The prefix cache is emptied before each
run: a later run of the same requests would otherwise skip their prompts."""
from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from tinyvllm.engine.llm import LLM
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
  """`num_prompts` requests; prompt and output lengths uniform in the inclusive ranges, prompt ids uniform in
  [0, vocab); request i samples with seed i."""
  num_prompts: int
  input_lens: tuple[int, int]
  output_lens: tuple[int, int]
  vocab: int
  temperature: float = 1.0
  seed: int = 0

  @staticmethod
  def random(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int = 0) -> Workload:
    """vLLM's random dataset: lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)], temperature 1."""
    span = lambda n: (max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))
    return Workload(num_prompts, span(input_len), span(output_len), vocab, 1.0, seed)

  def requests(self) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(self.seed)
    prompts = [rng.integers(0, self.vocab, int(rng.integers(self.input_lens[0], self.input_lens[1] + 1))).tolist()
               for _ in range(self.num_prompts)]
    outputs = rng.integers(self.output_lens[0], self.output_lens[1] + 1, self.num_prompts)
    params = [SamplingParams(temperature=self.temperature, ignore_eos=True, max_tokens=int(n), seed=i) for i, n in enumerate(outputs)]
    return prompts, params


def nano_vllm_workload(vocab_size: int, num_prompts: int = 256, seed: int = 0) -> Workload:
  """nano-vllm's benchmark (workload 2 of the benchmarks reference): 256 requests, prompt and output lengths uniform in
  [100, 1024], ids below 10,000, temperature 0.6."""
  return Workload(num_prompts, (100, 1024), (100, 1024), min(10000, vocab_size), 0.6, seed)


@dataclass
class ThroughputResult:
  requests: int
  prompt_tokens: int
  output_tokens: int
  seconds: float
  cpu_seconds: float = 0.0          # this process's CPU time in the timed run: less disturbed by other processes
  warmup_seconds: list[float] = field(default_factory=list)
  captures: int = 0                 # step layouts captured in all, warm-up included
  captures_in_timed_run: int = 0    # of them, captured during the timed run (0 once the warm-up met every layout)

  @property
  def output_tok_s(self) -> float: return self.output_tokens / self.seconds

  @property
  def total_tok_s(self) -> float: return (self.prompt_tokens + self.output_tokens) / self.seconds

  @property
  def requests_s(self) -> float: return self.requests / self.seconds

  def line(self) -> str:
    return (f"throughput: {self.requests} requests, {self.prompt_tokens} prompt + {self.output_tokens} output tokens in "
            f"{self.seconds:.2f} s: {self.output_tok_s:.0f} output tok/s, {self.total_tok_s:.0f} total tok/s, "
            f"{self.requests_s:.2f} requests/s")

  def cpu_line(self) -> str:
    return (f"process CPU time of the timed run: {self.cpu_seconds:.2f} s ({self.output_tokens / self.cpu_seconds:.0f} output "
            "tokens per CPU second)")

  def warmup_line(self) -> str:
    runs = ", ".join(f"{s:.2f} s" for s in self.warmup_seconds) or "none"
    return (f"warm-up runs: {runs}; {self.captures} step layouts captured in all, {self.captures_in_timed_run} of them "
            "in the timed run")


@dataclass
class Run:
  seconds: float
  cpu_seconds: float
  prompt_lens: list[int]
  output_lens: list[int]


def run_once(llm: LLM, workload: Workload) -> Run:
  """One `generate` of the workload from an empty prefix cache."""
  prompts, params = workload.requests()
  llm.engine.reset_prefix_cache()
  gc.collect()   # not inside the timed generate
  start, cpu_start = time.perf_counter(), time.process_time()
  outputs = llm.generate(prompts, params, use_tqdm=False)
  seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
  return Run(seconds, cpu_seconds, [len(p) for p in prompts], [len(o.outputs[0].token_ids) for o in outputs])


def run_throughput(llm: LLM, workload: Workload, warmups: list[Workload] | tuple[Workload, ...] = ()) -> ThroughputResult:
  """Each warm-up workload runs untimed, then `workload` once, timed."""
  warmup_seconds = [run_once(llm, w).seconds for w in warmups]
  before = llm.engine.runner.num_captures
  run = run_once(llm, workload)
  runner = llm.engine.runner
  return ThroughputResult(workload.num_prompts, sum(run.prompt_lens), sum(run.output_lens), run.seconds, run.cpu_seconds,
                          warmup_seconds, runner.num_captures, runner.num_captures - before)


ENGINE_SETTINGS = ("scheduler", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
                   "cudagraph_mode")


def report_json(result: ThroughputResult, workload: Workload, flags: dict, engine: LLMEngine, model: str) -> dict:
  """The run as JSON: the workload and the flags that made it, the engine's settings, the machine, then the results
  (vLLM's keys first)."""
  return {"config": {**vars(workload), **flags},
          "engine": {"model": model, "device": engine.device, "attention_backend": engine.model.backend.describe(),
                     **{name: getattr(engine.config, name) for name in ENGINE_SETTINGS}},
          "machine": machine(),
          "elapsed_time": result.seconds, "num_requests": result.requests,
          "total_num_tokens": result.prompt_tokens + result.output_tokens, "requests_per_second": result.requests_s,
          "tokens_per_second": result.total_tok_s, "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens,
          "output_tokens_per_second": result.output_tok_s, "cpu_seconds": result.cpu_seconds,
          "output_tokens_per_cpu_second": result.output_tokens / result.cpu_seconds,
          "warmup_seconds": result.warmup_seconds, "captures": result.captures,
          "captures_in_timed_run": result.captures_in_timed_run, "preemptions": engine.scheduler.num_preemptions}


def machine() -> dict[str, object]:
  """The host the numbers come from: CPU model, cores, OS, and when."""
  cpu = platform.processor() or platform.machine()
  cpuinfo = Path("/proc/cpuinfo")
  if cpuinfo.is_file():
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")), cpu)
  return {"cpu": cpu, "cores": os.cpu_count(), "system": f"{platform.system()} {platform.release()}",
          "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
