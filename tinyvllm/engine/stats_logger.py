"""The periodic stats line of a running engine (vLLM's LoggingStatLogger): throughput since the last line, running,
swapped (with preemption_mode swap, as vLLM's V0 line) and waiting requests, KV cache use, prefix-cache hit rate,
speculative decoding's acceptance (since start). Off
with disable_log_stats (the offline LLM's default)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tinyvllm.engine.messages import SchedulerStats, SpecDecodingStats

LOG_STATS_INTERVAL_S = 10.0   # vLLM's default interval


@dataclass(frozen=True)
class EngineSnapshot:
  running: int
  waiting: int
  kv_cache_usage: float      # 0..1
  prefix_cache_hit_rate: float | None   # 0..1; None without a prefix cache
  swapped: int | None = None   # requests with a sequence in the swap space; None without one (preemption_mode recompute)
  spec: SpecDecodingStats | None = None   # speculative decoding's totals since start; None without it


class StatsLogger:
  def __init__(self, log: Callable[[str], None], interval: float = LOG_STATS_INTERVAL_S,
               clock: Callable[[], float] = time.monotonic):
    self.log, self.interval, self.clock = log, interval, clock
    self.last = clock()
    self.prompt_tokens = self.generation_tokens = 0

  def record(self, prompt_tokens: int, generation_tokens: int) -> None:
    self.prompt_tokens += prompt_tokens
    self.generation_tokens += generation_tokens

  def observe(self, stats: SchedulerStats) -> None:
    """A core step's stats: count its prompt tokens and samples; the line goes out once an interval."""
    self.record(stats.step_prompt_tokens, stats.step_generation_tokens)
    self.maybe_log(lambda: EngineSnapshot(stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage,
                                          stats.prefix_cache_hit_rate if stats.prefix_caching else None,
                                          stats.swap.num_swapped_reqs if stats.swap is not None else None, stats.spec_decoding))

  def maybe_log(self, snapshot_of: Callable[[], EngineSnapshot]) -> None:
    """Log a line when the interval has passed, unless nothing happened and nothing waits (an idle engine stays quiet)."""
    now = self.clock()
    if now - self.last < self.interval: return
    snapshot = snapshot_of()
    if self.prompt_tokens or self.generation_tokens or snapshot.running or snapshot.waiting or snapshot.swapped:
      self.log(self.line(snapshot, now - self.last))
    self.last, self.prompt_tokens, self.generation_tokens = now, 0, 0

  def line(self, snapshot: EngineSnapshot, elapsed: float) -> str:
    hit = "" if snapshot.prefix_cache_hit_rate is None else f", Prefix cache hit rate: {100 * snapshot.prefix_cache_hit_rate:.1f}%"
    swapped = "" if snapshot.swapped is None else f"Swapped: {snapshot.swapped} reqs, "
    return (f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, Running: {snapshot.running} reqs, "
            f"{swapped}Waiting: {snapshot.waiting} reqs, KV cache usage: {100 * snapshot.kv_cache_usage:.1f}%{hit}"
            f"{_spec(snapshot.spec)}")


def _spec(spec: SpecDecodingStats | None) -> str:
  if spec is None or not spec.num_drafts: return ""
  return (f", Speculative decoding: {100 * spec.acceptance_rate:.1f}% of proposals accepted, "
          f"{spec.mean_acceptance_length:.2f} tokens per verification")
