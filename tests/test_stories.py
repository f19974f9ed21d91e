"""Acceptance 2 and 6: the real stories260K weights reproduce their recorded greedy output, also from the CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm import SamplingParams

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=256)


def test_greedy_from_bos(llm, reference):
  out = llm.generate([reference["prompt_ids"]], GREEDY, use_tqdm=False)[0].outputs[0]
  assert out.token_ids == reference["greedy_ids"]
  assert out.text == reference["greedy_text"]
  assert out.finish_reason == "length"


def test_zoo_prompt(llm, reference):
  zoo = reference["zoo"]
  assert llm.get_tokenizer().encode("Zoo") == zoo["prompt_ids"]
  out = llm.generate("Zoo", SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
  assert out.prompt_token_ids + out.outputs[0].token_ids == zoo["greedy_ids_64"]


@pytest.mark.slow
def test_first_positions_argmax(llm, reference):
  ids = reference["prompt_ids"] + reference["greedy_ids"]
  argmax = [int(llm.engine.compute_logits(ids[:i + 1]).argmax()) for i in range(0, 32, 7)]
  assert argmax == reference["logits_first32_argmax"][0:32:7]


@pytest.mark.slow
def test_cli_generate_prints_a_story(stories_dir, llm):
  cmd = [sys.executable, "main.py", "generate", "--model", str(stories_dir), "--prompt", "Once upon a time",
         "--max-tokens", "64", "--temperature", "0"]
  run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  expected = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
  assert run.stdout == expected.outputs[0].text + "\n"
  assert "Lily" in run.stdout and "backend CPU" in run.stderr
