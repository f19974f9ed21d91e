"""`bench throughput`: vLLM's random-dataset lengths, a timed run that meets only step layouts its warm-up runs met,
and a JSON report whose numbers add up."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm.bench.throughput import Workload, nano_vllm_workload

REPO = Path(__file__).resolve().parents[1]


def test_random_workload_lengths_follow_the_range_ratio():
  w = Workload.random(32, 64, 128, 0.5, vocab=512, seed=3)
  assert (w.input_lens, w.output_lens, w.temperature) == ((32, 96), (64, 192), 1.0)
  prompts, params = w.requests()
  assert len(prompts) == len(params) == 32 and all(32 <= len(p) <= 96 and max(p) < 512 for p in prompts)
  assert all(64 <= p.max_tokens <= 192 and p.ignore_eos and p.seed == i for i, p in enumerate(params))
  assert len({len(p) for p in prompts}) > 10 and len({p.max_tokens for p in params}) > 10   # really spread
  again, _ = Workload.random(32, 64, 128, 0.5, vocab=512, seed=3).requests()
  other, _ = Workload.random(32, 64, 128, 0.5, vocab=512, seed=4).requests()
  assert again == prompts and other != prompts
  fixed = Workload.random(4, 10, 7, 0.0, vocab=512).requests()
  assert [len(p) for p in fixed[0]] == [10] * 4 and [p.max_tokens for p in fixed[1]] == [7] * 4


def test_nano_vllm_workload():
  w = nano_vllm_workload(151936)
  assert (w.num_prompts, w.input_lens, w.output_lens, w.vocab, w.temperature) == (256, (100, 1024), (100, 1024), 10000, 0.6)


def throughput(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "main.py", "bench", "throughput", "--output-json", str(tmp_path / "t.json"), *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_cli_runs_the_mix_after_its_warm_ups(stories_dir, tmp_path, scheduler):
  run = throughput(tmp_path, "--model", str(stories_dir), "--num-prompts", "6", "--input-len", "12", "--output-len", "10",
                   "--random-range-ratio", "0.5", "--max-num-seqs", "2", "--num-iters-warmup", "2", "--scheduler", scheduler,
                   "--num-gpu-blocks", "64")
  assert run.returncode == 0, run.stderr
  r = json.loads((tmp_path / "t.json").read_text())
  prompts, params = Workload.random(6, 12, 10, 0.5, vocab=512).requests()
  assert r["num_requests"] == 6 and r["prompt_tokens"] == sum(map(len, prompts))
  assert r["output_tokens"] == sum(p.max_tokens for p in params)     # ignore_eos: exactly what was drawn
  assert r["total_num_tokens"] == r["prompt_tokens"] + r["output_tokens"]
  assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
  assert r["output_tokens_per_second"] == pytest.approx(r["output_tokens"] / r["elapsed_time"])
  assert r["requests_per_second"] == pytest.approx(6 / r["elapsed_time"])
  assert len(r["warmup_seconds"]) == 2 and r["captures"] > 0 and r["captures_in_timed_run"] == 0
  assert r["engine"]["scheduler"] == scheduler and r["engine"]["max_num_seqs"] == 2 and r["engine"]["device"] == "CPU"
  assert r["machine"]["cores"] >= 1 and r["machine"]["cpu"] and r["config"]["input_lens"] == [6, 18]
  assert f"throughput: 6 requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens" in run.stdout
  assert "0 of them in the timed run" in run.stdout and "process CPU time of the timed run" in run.stdout
  assert r["cpu_seconds"] > 0 and r["output_tokens_per_cpu_second"] == pytest.approx(r["output_tokens"] / r["cpu_seconds"])


@pytest.mark.slow
def test_cli_refuses_a_mix_that_cannot_run(stories_dir, tmp_path):
  bad = throughput(tmp_path, "--model", str(stories_dir), "--random-range-ratio", "1")
  assert bad.returncode == 2 and "argument --random-range-ratio: must be a number in [0, 1), got '1'" in bad.stderr
  long = throughput(tmp_path, "--model", str(stories_dir), "--input-len", "400", "--output-len", "200", "--num-gpu-blocks", "64")
  assert long.returncode == 2 and "exceeds the context (512)" in long.stderr and not (tmp_path / "t.json").exists()
