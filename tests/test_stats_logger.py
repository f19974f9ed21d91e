"""The periodic stats line (vLLM's, off with disable_log_stats, the offline LLM's default) and the server's request log."""
from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.messages import SpecDecodingStats
from tinyvllm.engine.stats_logger import EngineSnapshot, StatsLogger
from tinyvllm.entrypoints.logger import RequestLogger


class Clock:
  def __init__(self) -> None: self.now = 100.0
  def __call__(self) -> float: return self.now


def test_one_line_an_interval_with_the_rates_since_the_last():
  lines, clock = [], Clock()
  stats = StatsLogger(lines.append, interval=10.0, clock=clock)
  busy = lambda: EngineSnapshot(running=3, waiting=1, kv_cache_usage=0.25, prefix_cache_hit_rate=0.5)
  stats.record(prompt_tokens=400, generation_tokens=30)
  clock.now += 5
  stats.maybe_log(busy)
  assert lines == []   # not yet
  stats.record(prompt_tokens=100, generation_tokens=20)
  clock.now += 5
  stats.maybe_log(busy)
  assert lines == ["Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
                   "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%"]
  clock.now += 10
  stats.maybe_log(lambda: EngineSnapshot(0, 0, 0.0, None))
  assert len(lines) == 1   # nothing happened and nothing waits: an idle engine stays quiet
  stats.record(prompt_tokens=0, generation_tokens=90)
  clock.now += 10
  stats.maybe_log(lambda: EngineSnapshot(1, 0, 0.5, None, spec=SpecDecodingStats(10, 40, 20)))
  assert lines[-1].endswith("KV cache usage: 50.0%, Speculative decoding: 50.0% of proposals accepted, 3.00 tokens per verification")


@pytest.mark.slow
def test_the_engine_logs_stats_unless_disabled(stories_dir, reference, capsys):
  quiet = LLM(str(stories_dir), num_gpu_blocks=32)   # the offline LLM's default, as vLLM's
  assert quiet.engine.stats_logger is None
  llm = LLM(str(stories_dir), num_gpu_blocks=32, disable_log_stats=False)
  assert llm.engine.stats_logger is not None
  llm.engine.stats_logger.interval = 0.0
  capsys.readouterr()
  llm.generate(reference["prompt_ids"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
  assert "Avg prompt throughput:" in capsys.readouterr().err


@pytest.mark.parametrize("max_log_len, prompt, ids", [(None, "'Once upon a time'", "[1, 2, 3, 4, 5]"), (4, "'Once'", "[1, 2, 3, 4]")])
def test_the_request_log_line(max_log_len, prompt, ids):
  lines: list[str] = []
  RequestLogger(lines.append, max_log_len).log_inputs("cmpl-1-0", "Once upon a time", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
  (line,) = lines
  assert line.startswith(f"Received request cmpl-1-0: prompt: {prompt}, params: SamplingParams(") and "max_tokens=3" in line
  assert line.endswith(f"prompt_token_ids: {ids}")
