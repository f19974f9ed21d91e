"""The server against a user trying to break it: a huge request does not starve a small one, HEAD works where GET
does, CORS is off unless asked for, the Host is checked on the loopback, token ids come back beside (or, without a
tokenizer, instead of) the text, unsupported content parts are named, and a second Ctrl-C ends the requests in flight
quietly."""
from __future__ import annotations

import contextlib
import json
import shutil
import signal
import threading
import time

import h11
import httpx
import pytest

from tests.raw_http import RawConnection
from tests.server_process import ServerProcess, StreamReader, model_with_chat_template
from tests.test_server_errors import metrics
from tinyvllm.entrypoints.api_server import ServerSettings
from tinyvllm.entrypoints.guard import host_name

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
  model = model_with_chat_template(stories_dir, tmp_path_factory.mktemp("model") / "stories")
  log = tmp_path_factory.mktemp("log") / "server.log"
  with ServerProcess(model, log, "--served-model-name", "stories", "--max-seqs-per-request", "38400") as s:
    yield s


@pytest.fixture(scope="module")
def http(server):
  with httpx.Client(base_url=server.url, timeout=120) as c: yield c


def wait_until(predicate, timeout: float = 60) -> None:
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


def send_ignoring_close(conn: RawConnection, body: bytes) -> None:
  """Send a request whose answer is never read: the test closes the connection under it."""
  with contextlib.suppress(OSError, h11.ProtocolError): conn.request("POST", CMPL, body, {"content-type": "application/json"})


@pytest.mark.slow
def test_a_small_request_finishes_while_300_prompts_with_n_128_run(server, http):
  small = {"prompt": "Zoo", "max_tokens": 4, "temperature": 0}
  alone = http.post(CMPL, json=small).json()["choices"][0]["text"]
  big = json.dumps({"prompt": ["Once upon a time"] * 300, "n": 128, "max_tokens": 16}).encode()
  conn = RawConnection(server.port, timeout=600)
  try:
    sender = threading.Thread(target=send_ignoring_close, args=(conn, big), daemon=True)
    sender.start()
    wait_until(lambda: metrics(server)["tinyvllm:num_requests_running"] >= 2 and metrics(server)["tinyvllm:num_requests_waiting"] > 100)
    for _ in range(5): assert http.post(CMPL, json=small).status_code == 200   # the CPU compiles the steps' new shapes
    for _ in range(3):   # each of them while the big request holds the batch
      start = time.monotonic()
      r = http.post(CMPL, json=small)
      took = time.monotonic() - start
      # (it takes ~0.2-2 s on two busy cores; starved, it would wait for 38,400 sequences' 16 tokens, minutes)
      assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone and took < 10.0, took
      assert metrics(server)["tinyvllm:num_requests_waiting"] > 50   # the big request is still far from done
  finally:
    conn.close()   # the client goes away: its 300 requests are aborted
  wait_until(lambda: metrics(server)["tinyvllm:kv_cache_blocks_used"] == 0 and metrics(server)["tinyvllm:num_requests_running"] == 0)


def test_more_sequences_than_the_limit_is_a_400_naming_the_flag(http):
  r = http.post(CMPL, json={"prompt": ["a"] * 301, "n": 128, "max_tokens": 1})
  err = r.json()["error"]
  assert r.status_code == 400 and err["param"] == "n" and "38528 sequences" in err["message"]
  assert "--max-seqs-per-request" in err["message"]


def test_head_wherever_get_is_allowed(http):
  for path in ("/health", "/v1/models", "/metrics"):
    r = http.head(path)
    assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0, path
  r = http.head(CMPL)
  assert r.status_code == 405 and r.content == b""


def test_cors_is_off_unless_origins_are_given(http):
  preflight = {"Origin": "https://example.org", "Access-Control-Request-Method": "POST"}
  assert "access-control-allow-origin" not in http.options(CMPL, headers=preflight).headers
  r = http.get("/health", headers={"Origin": "https://example.org"})
  assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_return_token_ids(http):
  body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
  choice = http.post(CMPL, json=body).json()["choices"][0]
  assert choice["prompt_token_ids"] == http.post("/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
  assert len(choice["token_ids"]) == 6
  assert http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
  with http.stream("POST", CMPL, json={**body, "stream": True}) as r:
    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
  assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
  assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
  assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
  chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "return_token_ids": True}
  out = http.post(CHAT, json=chat).json()
  assert len(out["choices"][0]["token_ids"]) == 4 and out["prompt_token_ids"][0] == 1
  plain = http.post(CMPL, json={**body, "return_token_ids": False}).json()["choices"][0]
  assert plain["token_ids"] is None and plain["prompt_token_ids"] is None and plain["text"] == choice["text"]


def test_an_image_part_is_named_unsupported(http):
  r = http.post(CHAT, json={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
  err = r.json()["error"]
  assert r.status_code == 400 and err["param"] == "messages" and "'image_url' are not supported" in err["message"]
  assert "text only" in err["message"]


def test_host_names_and_defaults():
  assert [host_name(h) for h in ("localhost:8000", "[::1]:80", "[::1]", "127.0.0.1", "Example.org:1")] == \
         ["localhost", "::1", "::1", "127.0.0.1", "example.org"]
  assert set(ServerSettings(host="127.0.0.1").hosts()) == {"localhost", "127.0.0.1", "::1"}
  assert set(ServerSettings(host="::1").hosts()) == {"localhost", "127.0.0.1", "::1"}
  assert ServerSettings(host="0.0.0.0").hosts() is None                          # bound to every address: any Host
  assert ServerSettings(host="0.0.0.0", allowed_hosts=["api.example"]).hosts() == ["api.example"]
  assert ServerSettings(uds="/tmp/x.sock").hosts() is None


@pytest.fixture(scope="module")
def tokenizerless(stories_dir, tmp_path_factory):
  """stories260K without its tokenizer files: prompts are token ids, outputs have no text."""
  folder = tmp_path_factory.mktemp("model") / "bare"
  folder.mkdir()
  for name in ("config.json", "generation_config.json", "model.safetensors"): shutil.copy(stories_dir / name, folder / name)
  with ServerProcess(folder, tmp_path_factory.mktemp("log") / "server.log", "--allowed-hosts", '["api.example", "127.0.0.1"]') as s:
    yield s


@pytest.mark.slow
def test_without_a_tokenizer_completions_carry_token_ids(tokenizerless, reference):
  url, host = f"{tokenizerless.url}{CMPL}", {"Host": "api.example"}
  prompt = reference["prompt_ids"]
  r = httpx.post(url, json={"prompt": prompt, "max_tokens": 8, "temperature": 0}, headers=host)
  choice = r.json()["choices"][0]
  assert r.status_code == 200 and choice["text"] == "" and choice["prompt_token_ids"] == prompt
  assert choice["token_ids"] == reference["greedy_ids"][:8]
  stop = httpx.post(url, json={"prompt": prompt, "stop": ["x"]}, headers=host)
  assert stop.status_code == 400 and stop.json()["error"]["param"] == "stop"
  text = httpx.post(url, json={"prompt": "Once"}, headers=host)
  assert text.status_code == 400 and text.json()["error"]["param"] == "prompt" and "no tokenizer" in text.json()["error"]["message"]
  refused = httpx.post(url, json={"prompt": prompt, "max_tokens": 1}, headers={"Host": "localhost"})   # not in --allowed-hosts
  assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_host"


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_requests_in_flight_quietly(stories_dir, tmp_path):
  with ServerProcess(stories_dir, tmp_path / "server.log", "--shutdown-timeout", "60") as s:
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    readers = [StreamReader(f"{s.url}{CMPL}", {**body, "stream": True}) for _ in range(20)]
    for reader in readers: reader.start()
    for reader in readers: assert reader.started.wait(120)
    s.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(30) == 0
    for reader in readers: reader.join(30)
  for reader in readers:
    assert reader.error is None and reader.lines[-1] == "data: [DONE]"
    assert reader.chunks()[-1]["error"]["code"] == "service_unavailable"
  log = s.log()
  assert "Traceback" not in log and "CancelledError" not in log and "ending the requests in flight now" in log
