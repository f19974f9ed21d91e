"""A real `serve MODEL` process (vLLM's form) with vLLM's server flags: the chat template given, the request log,
the stats line, several model names, CORS, max_logprobs; each checked on what the server does."""
from __future__ import annotations

import httpx
import pytest

from tests.server_process import ServerProcess
from tinyvllm.tokenizer import load_tokenizer

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "Tell me about the cat"}]


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
  folder = tmp_path_factory.mktemp("serve")
  (folder / "template.jinja").write_text(TEMPLATE)
  with ServerProcess(stories_dir, folder / "server.log", "--served-model-name", "stories", "tiny", "--chat-template",
                     str(folder / "template.jinja"), "--enable-log-requests", "--max-log-len", "50", "--uvicorn-log-level",
                     "warning", "--max-logprobs", "2", "--num-gpu-blocks", "64", "-tp", "1", "--trust-remote-code",
                     "--disable-frontend-multiprocessing", "--allowed-origins", '["https://example.org"]',
                     positional=True) as s:
    yield s


@pytest.mark.slow
def test_chat_and_tokenize_use_the_given_template(server, stories_dir):
  rendered = load_tokenizer(stories_dir).apply_chat_template(MESSAGES, add_generation_prompt=True, chat_template=TEMPLATE)
  assert rendered == "<s>user says Tell me about the cat\n"
  ids = load_tokenizer(stories_dir).encode(rendered, add_special_tokens=False)
  counted = httpx.post(f"{server.url}/tokenize", json={"model": "stories", "messages": MESSAGES}).json()
  assert counted["tokens"] == ids
  chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                                                               "temperature": 0}, timeout=60).json()
  assert chat["usage"]["prompt_tokens"] == len(ids) and chat["model"] == "stories"   # responses carry the first name


@pytest.mark.slow
def test_the_request_log_and_max_logprobs(server):
  r = httpx.post(f"{server.url}/v1/completions", json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 2,
                                                       "logprobs": 3}, timeout=60)
  assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs" and "max_logprobs (2)" in r.json()["error"]["message"]
  ok = httpx.post(f"{server.url}/v1/completions", json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 2,
                                                        "logprobs": 2}, timeout=60)
  assert ok.status_code == 200
  line = next(line for line in server.log().splitlines() if "Received request cmpl-" in line)
  assert "prompt: 'Once upon a time'" in line and "prompt_token_ids: [1, 403, 407, 261, 378]" in line and "logprobs=2" in line
  assert "trust_remote_code=True accepted" in server.log()


@pytest.mark.slow
def test_cors_answers_the_allowed_origin_only(server):
  preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
  allowed = httpx.options(f"{server.url}/v1/completions", headers={"Origin": "https://example.org", **preflight})
  assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://example.org"
  other = httpx.options(f"{server.url}/v1/completions", headers={"Origin": "https://evil.example", **preflight})
  assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
