"""`bench decode`: with and without the KV cache it decodes the same tokens (the no-cache mode really recomputes)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm import LLM
from tinyvllm.bench.decode import run_decode_bench

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_both_modes_decode_the_same_tokens(stories_dir):
  llm = LLM(str(stories_dir), max_num_seqs=4, num_gpu_blocks=64)
  cached, recomputed = run_decode_bench(llm.engine, batch=2, prompt_len=20, new_tokens=12, no_kv_cache=True)
  assert cached.token_ids == recomputed.token_ids and len(cached.token_ids[0]) == 12
  assert cached.decode_tok_s > 0 and recomputed.decode_tok_s > 0
  # the decode phase's steps, timed one by one, add up to its time
  assert len(cached.step_s) >= 11 and sum(cached.step_s) == pytest.approx(cached.decode_s)
  assert 0 < cached.median_step_ms <= max(cached.step_s) * 1e3 and 0 <= cached.slow_steps < len(cached.step_s)
  assert llm.engine.allocator.num_used_blocks == 0  # everything freed (cached blocks stay, unreferenced)


@pytest.mark.slow
def test_cli_reports_both(stories_dir):
  cmd = [sys.executable, "main.py", "bench", "decode", "--model", str(stories_dir), "--prompt-len", "16",
         "--max-tokens", "8", "--no-kv-cache", "--num-gpu-blocks", "64"]
  run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  assert "kv cache: batch 1, prompt 16, 8 new tokens" in run.stdout
  kv_line = next(line for line in run.stdout.splitlines() if line.strip().startswith("kv cache:"))
  assert "; median step " in kv_line and " slow)" in kv_line   # its steps were timed one by one
  assert "no kv cache: batch 1" in run.stdout and "each step a full prefill of the sequence so far as a fresh request" in run.stdout
  assert "the KV cache makes decoding" in run.stdout and "faster than a full prefill of the sequence for every token" in run.stdout


def test_help_says_what_no_kv_cache_measures():
  run = subprocess.run([sys.executable, "main.py", "bench", "decode", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, run.stderr
  text = " ".join(run.stdout.split())
  assert "a fresh one-token request over the whole sequence so far" in text and "a full prefill of prompt + tokens so far" in text


@pytest.mark.slow
def test_speculative_decoding_reports_its_counts_on_repeated_prompts(stories_dir):
  """Repeated prompts hold the text the model goes on with: n-gram proposals are accepted, the greedy tokens are those
  of plain decoding, and the line says how many were proposed and accepted."""
  spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
  plain = LLM(str(stories_dir), max_num_seqs=4, num_gpu_blocks=64)
  fast = LLM(str(stories_dir), max_num_seqs=4, num_gpu_blocks=64, speculative_config=spec)
  (ref,) = run_decode_bench(plain.engine, batch=2, prompt_len=64, new_tokens=24, no_kv_cache=False, repeated=True)
  (ours,) = run_decode_bench(fast.engine, batch=2, prompt_len=64, new_tokens=24, no_kv_cache=False, repeated=True)
  assert ours.token_ids == ref.token_ids and ref.spec is None
  assert ours.spec.num_accepted_tokens > 0 and ours.spec.num_drafts > 0
  assert f"{ours.spec.num_draft_tokens} proposed, {ours.spec.num_accepted_tokens} accepted" in ours.line()
