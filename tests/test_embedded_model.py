"""The model shipped in the package (tinyvllm/assets/stories260K): the converter reproduces it from llama2.c's originals,
it equals an independent conversion, it reproduces llama2.c's documented greedy story, HF transformers loads it and
agrees with us, and `generate`, `chat` and `serve` run it when no --model is given (the README's run command too)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.server_process import ServerProcess
from tinyvllm import LLM, SamplingParams
from tinyvllm.model.embedded import embedded_model_path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = embedded_model_path()
# llama2.c's doc/stories260K.md: `./run stories260K.bin -z tok512.bin -t 0.0` prints this first line (and more)
DOCUMENTED_START = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw "
                    "a big, red ball. She wanted to play with it, but it was too high.")
MESSAGES = [{"role": "user", "content": "Once upon a time there was a dog named Max. "},
            {"role": "assistant", "content": " Max loved to run."}, {"role": "user", "content": "One day Max saw a cat."}]


@pytest.fixture(scope="module")
def llm():
  return LLM(str(SHIPPED), max_num_seqs=4, num_gpu_blocks=64)


def test_the_shipped_folder_is_inside_the_package():
  assert SHIPPED.is_relative_to(REPO / "tinyvllm")
  assert sorted(p.name for p in SHIPPED.iterdir()) == ["LICENSE", "README.md", "config.json", "generation_config.json",
                                                      "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
  license_text = (SHIPPED / "LICENSE").read_text()
  assert license_text.startswith("MIT License\n\nCopyright (c) 2023 Andrej\n") and "llama2.c" in (SHIPPED / "README.md").read_text()


@pytest.mark.slow
def test_the_script_reproduces_the_shipped_files(shared_data, tmp_path):
  originals = shared_data / "models" / "stories260K"
  run = subprocess.run([sys.executable, "scripts/convert_stories260k.py", str(originals / "stories260K.bin"),
                        str(originals / "tok512.model"), str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  out = tmp_path / "out"
  assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in SHIPPED.iterdir())
  made, shipped = load_file(str(out / "model.safetensors")), load_file(str(SHIPPED / "model.safetensors"))
  assert made.keys() == shipped.keys() and all(np.array_equal(made[k], shipped[k]) for k in made)
  for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    assert json.loads((out / name).read_text()) == json.loads((SHIPPED / name).read_text()), name
  for name in ("LICENSE", "README.md"): assert (out / name).read_text() == (SHIPPED / name).read_text()


def test_it_equals_an_independent_conversion(stories_dir):
  """../shared's stories260K-hf was converted from the same originals by someone else's converter."""
  ours, theirs = load_file(str(SHIPPED / "model.safetensors")), load_file(str(stories_dir / "model.safetensors"))
  assert ours.keys() == theirs.keys() and len(ours) == 2 + 9 * 5   # embedding (tied), final norm, 9 per layer
  assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
  for name in ("config.json", "tokenizer.json"):
    assert json.loads((SHIPPED / name).read_text()) == json.loads((stories_dir / name).read_text()), name


@pytest.mark.slow
def test_greedy_from_bos_is_the_reference_story(llm, reference):
  out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=256), use_tqdm=False)[0].outputs[0]
  assert out.token_ids == reference["greedy_ids"] and out.text == reference["greedy_text"]
  assert out.text.startswith(DOCUMENTED_START)


def test_greedy_story_matches_llama2c_documentation(llm):
  """Needs nothing outside the package: the start of the story llama2.c's own doc prints at temperature 0."""
  out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
  assert DOCUMENTED_START.startswith("Once upon a time" + out.outputs[0].text)


@pytest.fixture(scope="module")
def hf():
  from transformers import AutoTokenizer, LlamaForCausalLM
  return LlamaForCausalLM.from_pretrained(str(SHIPPED)).eval(), AutoTokenizer.from_pretrained(str(SHIPPED))


@pytest.mark.slow
def test_hf_transformers_loads_it_and_agrees(llm, hf):
  import torch
  model, tokenizer = hf
  ours = llm.get_tokenizer()
  for text in ("Once upon a time", "Zoo", "Lily's mom said, \"Don't worry!\"", "Tim  and  Sue\nran é 42"):
    assert ours.encode(text) == tokenizer(text)["input_ids"], text
  ids = tokenizer("One day, a big dog")["input_ids"]
  with torch.no_grad(): hf_logits = model(torch.tensor([ids])).logits[0, -1].numpy()
  np.testing.assert_allclose(llm.engine.compute_logits(ids), hf_logits, atol=1e-4, rtol=1e-4)
  with torch.no_grad(): hf_ids = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
  ours_ids = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].token_ids
  assert ours_ids == hf_ids


@pytest.mark.slow
def test_its_chat_template_renders_as_hf_renders_it(llm, hf):
  _, tokenizer = hf
  ours = llm.get_tokenizer()   # transformers' defaults: apply_chat_template tokenizes unless told not to
  text = ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
  assert text == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
  assert text == "<s>Once upon a time there was a dog named Max. Max loved to run. One day Max saw a cat."
  hf_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
  assert ours.encode(text, add_special_tokens=False) == hf_ids
  assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"] == hf_ids


def run_cli(*args: str, stdin: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(REPO / "main.py"), *args], cwd=cwd, input=stdin, capture_output=True, text=True,
                        timeout=300)


def readme_run_command() -> list[str]:
  """The README's run command (its first bash block: set-up && python main.py ...), minus the set-up."""
  block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
  line = next(line for line in block.splitlines() if "main.py" in line)
  command = shlex.split(line.split("&&")[-1])
  assert command[0] == ".venv/bin/python" and command[1] == "main.py", command
  return command[2:]


@pytest.mark.slow
def test_the_readme_run_command_prints_the_story(tmp_path):
  """Run from a directory with no ../shared beside it; it needs neither test data nor the network."""
  args = readme_run_command()
  assert "--model" not in args and not any("shared" in a for a in args)
  run = run_cli(*args, cwd=tmp_path)
  assert run.returncode == 0, run.stderr
  assert "no model given: running the embedded stories260K" in run.stderr
  assert len(run.stdout) > 100 and DOCUMENTED_START.startswith("Once upon a time" + run.stdout.rstrip("\n")[:150])


@pytest.mark.slow
def test_chat_without_a_model_cowrites_a_story(llm):
  run = run_cli("chat", "--temperature", "0", "--max-tokens", "12", "--num-gpu-blocks", "64",
                stdin="Once upon a time there was a dog named Max.\n/exit\n")
  assert run.returncode == 0, run.stderr
  expected = llm.chat([{"role": "user", "content": "Once upon a time there was a dog named Max."}],
                      SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
  assert run.stdout == f"> {expected}\n> " and "embedded stories260K" in run.stderr


@pytest.mark.slow
def test_serve_without_a_model_serves_it(tmp_path, llm):
  with ServerProcess(None, tmp_path / "server.log", "--num-gpu-blocks", "64") as server:
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    text = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
  assert [m["id"] for m in models] == ["stories260K"]
  assert text == llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
  assert "no model given: running the embedded stories260K" in server.log()


def readme_client_example() -> str:
  """The README's OpenAI-client example (the python block that makes an OpenAI client), as written."""
  blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
  return next(b for b in blocks if "OpenAI(base_url=" in b)


@pytest.mark.slow
def test_the_readme_server_example_runs_as_written(tmp_path, llm):
  """`python main.py serve --api-key sk-local` and the README's client code against it (only its port is this test's)."""
  code = readme_client_example()
  assert "http://127.0.0.1:8000/v1" in code and 'api_key="sk-local"' in code
  with ServerProcess(None, tmp_path / "server.log", "--num-gpu-blocks", "64", api_key="sk-local") as server:
    run = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8000", server.url)], capture_output=True, text=True,
                         timeout=300)
  assert run.returncode == 0, run.stderr
  first = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0].text
  assert run.stdout.startswith(first + "\n") and len(run.stdout) > len(first) + 10   # the completion, then the streamed reply
