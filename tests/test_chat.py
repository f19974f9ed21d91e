"""llm.chat and the chat CLI on a tiny random Qwen3 with the real Qwen3 tokenizer and chat template."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_models import make_model
from tinyvllm import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, shared_data):
  folder = tmp_path_factory.mktemp("qwen3-tiny")
  make_model("qwen3", folder, head_dim=24, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=512)
  for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
    shutil.copy(shared_data / "tokenizers" / "qwen3" / name, folder / name)
  return folder


@pytest.fixture(scope="module")
def llm(qwen_dir):
  return LLM(str(qwen_dir), max_num_seqs=4, num_gpu_blocks=64)


def test_chat_uses_the_template(llm, qwen_dir):
  from transformers import AutoTokenizer
  hf = AutoTokenizer.from_pretrained(str(qwen_dir))
  out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False,
                 chat_template_kwargs={"enable_thinking": False})[0]
  text = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False, tokenize=False)
  assert out.prompt == text
  assert out.prompt_token_ids == hf(text, add_special_tokens=False)["input_ids"]
  assert out.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert len(out.outputs[0].token_ids) == 5


def test_chat_equals_generate_on_rendered_prompt(llm):
  params = SamplingParams(temperature=0, max_tokens=8)
  chat = llm.chat(MESSAGES, params, use_tqdm=False)[0]
  direct = llm.generate({"prompt_token_ids": chat.prompt_token_ids}, params, use_tqdm=False)[0]
  assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


@pytest.mark.slow
def test_chat_cli_session(qwen_dir, llm):
  cmd = [sys.executable, "main.py", "chat", "--model", str(qwen_dir), "--temperature", "0", "--max-tokens", "6",
         "--num-gpu-blocks", "64"]
  run = subprocess.run(cmd, cwd=REPO, input="What is 2+2?\n/reset\nhello\n/exit\n", capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0, run.stderr
  first = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=6),
                   use_tqdm=False)[0].outputs[0].text
  second = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=6),
                    use_tqdm=False)[0].outputs[0].text
  assert run.stdout.count("\n") >= 2 and first.strip() and second.strip() and first != second
  assert first in run.stdout and second in run.stdout


def test_chat_cli_without_template(stories_dir):
  run = subprocess.run([sys.executable, "main.py", "chat", "--model", str(stories_dir)], cwd=REPO, input="",
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 2 and "no chat template" in run.stderr
