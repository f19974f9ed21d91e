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


def test_chat_with_tools_and_continue_final_message_renders_as_transformers(llm, qwen_dir):
  """vLLM's LLM.chat arguments: tools reach the template, tool calls' arguments may be JSON strings (OpenAI's form),
  continue_final_message leaves the last message open."""
  from transformers import AutoTokenizer
  hf = AutoTokenizer.from_pretrained(str(qwen_dir))
  tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
  called = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
  params = SamplingParams(temperature=0, max_tokens=2)
  out = llm.chat(called, params, use_tqdm=False, tools=tools)[0]
  as_object = {**called[2]["tool_calls"][0], "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
  reference = [*called[:2], {**called[2], "tool_calls": [as_object]}, called[3]]
  assert out.prompt == hf.apply_chat_template(reference, tools=tools, add_generation_prompt=True, tokenize=False)
  partial = [*MESSAGES, {"role": "assistant", "content": "2+2 is"}]
  out = llm.chat(partial, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
  assert out.prompt == hf.apply_chat_template(partial, continue_final_message=True, tokenize=False) and out.prompt.endswith("2+2 is")


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
