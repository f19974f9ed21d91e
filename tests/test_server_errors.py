"""Bad requests get the right status and OpenAI's error shape, and the server keeps serving;
client disconnects abort their requests; SIGTERM shuts down gracefully."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server_process import REPO, ServerProcess, StreamReader

MODEL = "stories"
KEY = "sk-test-key"
GOOD = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
CMPL, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
HUGE = 5 << 20   # over the server's 4 MiB body limit
JSON_TYPE = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory, data_parallel_size):
  with ServerProcess(stories_dir, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", MODEL,
                     "--num-gpu-blocks", "64", "--data-parallel-size", str(data_parallel_size), api_key=KEY) as s:
    yield s


@pytest.fixture(scope="module")
def http(server):
  with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c: yield c


@pytest.fixture(scope="module")
def good_text(http):
  r = http.post(CMPL, json=GOOD)
  assert r.status_code == 200
  return r.json()["choices"][0]["text"]


def completion(**fields): return ("POST", CMPL, {"json": {**GOOD, **fields}})
def chat(**fields): return ("POST", CHAT_PATH, {"json": {**CHAT, **fields}})
def without(body: dict, key: str) -> dict: return {k: v for k, v in body.items() if k != key}
class Chunked:
  """A body of `size` bytes sent in 1 MiB chunks, without a length; iterable again for each parametrized server."""
  def __init__(self, size: int): self.size = size
  def __iter__(self): return (b"x" * (1 << 20) for _ in range(self.size >> 20))


# (case id, (method, path, httpx kwargs), status, param, code); headers=None means "send the right API key"
CASES = [
  ("no key", ("POST", CMPL, {"json": GOOD, "headers": {"Authorization": ""}}), 401, None, "invalid_api_key"),
  ("wrong key", ("POST", CMPL, {"json": GOOD, "headers": {"Authorization": "Bearer nope"}}), 401, None, "invalid_api_key"),
  ("wrong scheme", ("POST", CMPL, {"json": GOOD, "headers": {"Authorization": f"Basic {KEY}"}}), 401, None, "invalid_api_key"),
  ("key on tokenize", ("POST", "/tokenize", {"json": {"prompt": "x"}, "headers": {"Authorization": ""}}), 401, None, "invalid_api_key"),
  ("malformed json", ("POST", CMPL, {"content": b'{"prompt": "x",', "headers": JSON_TYPE}), 400, None, None),
  ("json array body", ("POST", CMPL, {"content": b"[1, 2]", "headers": JSON_TYPE}), 400, None, None),
  ("empty body", ("POST", CMPL, {"content": b"", "headers": JSON_TYPE}), 400, None, None),
  ("not utf-8", ("POST", CMPL, {"content": b'{"prompt": "\xff\xfe"}', "headers": JSON_TYPE}), 400, None, None),
  ("lone surrogate", ("POST", CMPL, {"content": b'{"prompt": "\\ud800"}', "headers": JSON_TYPE}), 400, None, None),
  ("nested 10,000 deep", ("POST", CMPL, {"content": b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}",
                                         "headers": JSON_TYPE}), 400, None, None),
  ("integer of 5,000 digits", ("POST", CMPL, {"content": b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
                                              "headers": JSON_TYPE}), 400, None, None),
  ("float beyond float64", ("POST", CMPL, {"content": b'{"prompt": "x", "temperature": 1e400}', "headers": JSON_TYPE}), 400,
   "temperature", None),
  ("NaN", ("POST", CMPL, {"content": b'{"prompt": "x", "temperature": NaN}', "headers": JSON_TYPE}), 400, None, None),
  ("text/plain body", ("POST", CMPL, {"content": json.dumps(GOOD).encode(), "headers": {"Content-Type": "text/plain"}}), 415,
   None, "unsupported_media_type"),
  ("form body", ("POST", CMPL, {"data": {"prompt": "x"}}), 415, None, "unsupported_media_type"),
  ("no content type", ("POST", CMPL, {"content": json.dumps(GOOD).encode()}), 415, None, "unsupported_media_type"),
  ("text/plain on chat", ("POST", CHAT_PATH, {"content": json.dumps(CHAT).encode(), "headers": {"Content-Type": "text/plain"}}),
   415, None, "unsupported_media_type"),
  ("foreign host", ("POST", CMPL, {"json": GOOD, "headers": {"Host": "evil.example:8000"}}), 400, None, "invalid_host"),
  ("foreign host on health", ("GET", "/health", {"headers": {"Host": "attacker.test"}}), 400, None, "invalid_host"),
  ("huge body", ("POST", CMPL, {"content": b"x" * HUGE}), 413, None, "request_too_large"),
  ("huge chunked body", ("POST", CMPL, {"content": Chunked(HUGE)}), 413, None, "request_too_large"),
  ("missing prompt", ("POST", CMPL, {"json": without(GOOD, "prompt")}), 400, "prompt", None),
  ("prompt number", completion(prompt=5), 400, "prompt", None),
  ("prompt mixed list", completion(prompt=[1, "a"]), 400, "prompt", None),
  ("prompt empty list", completion(prompt=[]), 400, "prompt", None),
  ("prompt empty ids", completion(prompt=[[]]), 400, "prompt", None),
  ("prompt id outside vocab", completion(prompt=[1, 99999]), 400, "prompt", None),
  ("prompt beyond context", completion(prompt="the cat " * 400), 400, "prompt", "context_length_exceeded"),
  ("max_tokens beyond context", completion(max_tokens=10000), 400, "prompt", "context_length_exceeded"),
  ("max_tokens string", completion(max_tokens="5"), 400, "max_tokens", None),
  ("max_tokens zero", completion(max_tokens=0), 400, "max_tokens", None),
  ("max_tokens negative", completion(max_tokens=-1), 400, "max_tokens", None),
  ("temperature string", completion(temperature="hot"), 400, "temperature", None),
  ("temperature negative", completion(temperature=-1), 400, "temperature", None),
  ("top_p zero", completion(top_p=0), 400, "top_p", None),
  ("top_p above one", completion(top_p=1.5), 400, "top_p", None),
  ("top_k negative", completion(top_k=-5), 400, "top_k", None),
  ("min_p above one", completion(min_p=2), 400, "min_p", None),
  ("presence_penalty", completion(presence_penalty=3), 400, "presence_penalty", None),
  ("frequency_penalty", completion(frequency_penalty=-3), 400, "frequency_penalty", None),
  ("repetition_penalty", completion(repetition_penalty=0), 400, "repetition_penalty", None),
  ("repetition_penalty 1e-300", completion(repetition_penalty=1e-300), 400, "repetition_penalty", None),
  ("top_p 1e-300", completion(top_p=1e-300), 400, "top_p", None),
  ("temperature 1e308", completion(temperature=1e308), 400, "temperature", None),
  ("temperature 1e-300", completion(temperature=1e-300), 400, "temperature", None),
  ("seed beyond 64 bits", completion(seed=1 << 70), 400, "seed", None),
  ("top_k beyond 64 bits", completion(top_k=10 ** 30), 400, "top_k", None),
  ("stop_token_ids beyond 64 bits", completion(stop_token_ids=[1 << 64]), 400, "stop_token_ids", None),
  ("prompt id beyond 64 bits", completion(prompt=[1, 1 << 64]), 400, "prompt", None),
  ("too many sequences", completion(prompt=["a"] * 40, n=128), 400, "n", None),
  ("n float", completion(n=1.5), 400, "n", None),
  ("n zero", completion(n=0), 400, "n", None),
  ("n too large", completion(n=1000), 400, "n", None),
  ("n larger than the cache", completion(n=100, max_tokens=30), 400, "prompt", None),
  ("seed string", completion(seed="x"), 400, "seed", None),
  ("stream string", completion(stream="yes"), 400, "stream", None),
  ("stream_options type", completion(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options", None),
  ("stop number", completion(stop=5), 400, "stop", None),
  ("stop list of numbers", completion(stop=[1, 2]), 400, "stop", None),
  ("stop empty string", completion(stop=[""]), 400, "stop", None),
  ("stop_token_ids negative", completion(stop_token_ids=[-1]), 400, "stop_token_ids", None),
  ("logprobs too large", completion(logprobs=6), 400, "logprobs", None),
  ("logprobs negative", completion(logprobs=-1), 400, "logprobs", None),
  ("prompt_logprobs too large", completion(prompt_logprobs=21), 400, "prompt_logprobs", None),
  ("prompt_logprobs string", completion(prompt_logprobs="1"), 400, "prompt_logprobs", None),
  ("logit_bias outside the vocabulary", completion(logit_bias={"99999999": 1.0}), 400, "logit_bias", None),
  ("logit_bias beyond 100", completion(logit_bias={"5": 101}), 400, "logit_bias", None),
  ("suffix", completion(suffix="The end."), 400, "suffix", "unsupported_parameter"),
  ("unknown field", completion(max_token=5), 400, "max_token", None),
  ("unknown model", completion(model="gpt-4"), 404, "model", "model_not_found"),
  ("chat no messages", ("POST", CHAT_PATH, {"json": without(CHAT, "messages")}), 400, "messages", None),
  ("chat empty messages", chat(messages=[]), 400, "messages", None),
  ("chat messages string", chat(messages="hi"), 400, "messages", None),
  ("chat bad role", chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages", None),
  ("chat content number", chat(messages=[{"role": "user", "content": 5}]), 400, "messages", None),
  ("chat image part", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
   "messages", None),
  ("chat unknown model", chat(model="gpt-4"), 404, "model", "model_not_found"),
  ("chat no template", chat(), 400, "messages", None),
  ("chat top_logprobs too large", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
  ("chat top_logprobs alone", chat(top_logprobs=2), 400, "top_logprobs", None),
  ("chat max_completion_tokens zero", chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
  ("chat temperature type", chat(temperature=[1]), 400, "temperature", None),
  ("get on completions", ("GET", CMPL, {}), 405, None, "method_not_allowed"),
  ("delete on chat", ("DELETE", CHAT_PATH, {}), 405, None, "method_not_allowed"),
  ("post on models", ("POST", "/v1/models", {"json": {}}), 405, None, "method_not_allowed"),
  ("unknown v1 path", ("POST", "/v1/embeddings", {"json": {}}), 404, None, "not_found"),
  ("unknown path", ("GET", "/nope", {}), 404, None, "not_found"),
  ("tokenize neither", ("POST", "/tokenize", {"json": {}}), 400, "prompt", None),
  ("tokenize unknown model", ("POST", "/tokenize", {"json": {"model": "x", "prompt": "hi"}}), 404, "model", "model_not_found"),
  ("detokenize outside vocab", ("POST", "/detokenize", {"json": {"tokens": [1, 99999]}}), 400, "tokens", None),
  ("detokenize strings", ("POST", "/detokenize", {"json": {"tokens": "abc"}}), 400, "tokens", None),
]


def test_there_are_at_least_40_cases():
  assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> dict:
  assert r.status_code == status, r.text
  body = r.json()
  assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
  err = body["error"]
  assert isinstance(err["message"], str) and err["message"]
  assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
  assert (err["param"], err["code"]) == (param, code), err
  return err


@pytest.mark.parametrize("request_spec,status,param,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_then_a_good_one(http, good_text, request_spec, status, param, code):
  method, path, kwargs = request_spec
  r = http.request(method, path, **kwargs)
  err = assert_error(r, status, param, code)
  if status == 401: assert r.headers["www-authenticate"] == "Bearer"
  if status == 405: assert "allow" in r.headers
  if code == "context_length_exceeded": assert "maximum context length is 512 tokens" in err["message"]
  after = http.post(CMPL, json=GOOD)
  assert after.status_code == 200 and after.json()["choices"][0]["text"] == good_text


def test_open_paths_need_no_key(server):
  assert httpx.get(f"{server.url}/health").status_code == 200
  assert httpx.get(f"{server.url}/metrics").status_code == 200
  assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_official_client_sees_the_errors(server, good_text):
  client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model=MODEL, prompt="hi", max_tokens=600)
  assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
  with pytest.raises(openai.NotFoundError): client.completions.create(model="nope", prompt="hi")
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
  assert client.completions.create(**GOOD).choices[0].text == good_text


def metrics(server) -> dict[str, float]:
  from prometheus_client.parser import text_string_to_metric_families
  return {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text) for s in f.samples}


def wait_idle(server, aborted_before: float, timeout: float = 30) -> dict[str, float]:
  """Poll /metrics until one more request was aborted and nothing holds a KV block."""
  deadline = time.monotonic() + timeout
  while True:
    m = metrics(server)
    idle = m["tinyvllm:kv_cache_blocks_used"] == 0 and m["tinyvllm:num_requests_running"] == 0
    if (idle and m["tinyvllm:request_aborted_total"] > aborted_before) or time.monotonic() > deadline: return m
    time.sleep(0.1)


LONG = {**GOOD, "max_tokens": 400, "ignore_eos": True}


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, http, good_text):
  aborted = metrics(server)["tinyvllm:request_aborted_total"]
  with http.stream("POST", CMPL, json={**LONG, "stream": True}) as r:
    assert r.status_code == 200
    lines = r.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    assert metrics(server)["tinyvllm:kv_cache_blocks_used"] > 0
  m = wait_idle(server, aborted)
  assert m["tinyvllm:request_aborted_total"] == aborted + 1 and m["tinyvllm:kv_cache_blocks_used"] == 0
  assert http.post(CMPL, json=GOOD).json()["choices"][0]["text"] == good_text


def test_disconnect_while_waiting_for_a_whole_completion(server, http, good_text):
  aborted = metrics(server)["tinyvllm:request_aborted_total"]
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(f"{server.url}{CMPL}", json=LONG, headers=server.headers, timeout=httpx.Timeout(60, read=1.0))
  m = wait_idle(server, aborted)
  assert m["tinyvllm:request_aborted_total"] == aborted + 1 and m["tinyvllm:kv_cache_blocks_used"] == 0
  assert http.post(CMPL, json=GOOD).json()["choices"][0]["text"] == good_text


def shut_down_mid_stream(server: ServerProcess, body: dict, sig: int) -> StreamReader:
  reader = StreamReader(f"{server.url}{CMPL}", {**body, "stream": True})
  reader.start()
  assert reader.started.wait(120) and reader.error is None
  assert server.stop(sig) == 0
  reader.join(30)
  with pytest.raises(httpx.ConnectError): httpx.get(f"{server.url}/health")
  return reader


@pytest.mark.slow
def test_sigterm_lets_in_flight_requests_finish_and_exits_0(stories_dir, tmp_path):
  with ServerProcess(stories_dir, tmp_path / "server.log", "--num-gpu-blocks", "64", "--shutdown-timeout", "60") as s:
    body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    reader = shut_down_mid_stream(s, body, signal.SIGTERM)
  assert reader.error is None and reader.lines[-1] == "data: [DONE]"
  chunks = reader.chunks()
  assert len(chunks) == 60 and chunks[-1]["choices"][0]["finish_reason"] == "length"
  log = s.log()
  assert "Application shutdown complete" in log and "Traceback" not in log


@pytest.mark.slow
def test_sigint_past_the_grace_period_ends_the_stream_with_an_error_and_exits_0(stories_dir, tmp_path):
  with ServerProcess(stories_dir, tmp_path / "server.log", "--num-gpu-blocks", "64", "--shutdown-timeout", "0.5") as s:
    reader = shut_down_mid_stream(s, {**LONG, "model": None, "max_tokens": 500}, signal.SIGINT)
  assert reader.error is None and reader.lines[-1] == "data: [DONE]"
  last = reader.chunks()[-1]
  assert last["error"]["code"] == "service_unavailable" and "shut down" in last["error"]["message"]
  assert 0 < len(reader.chunks()) - 1 < 500
  log = s.log()
  assert "Application shutdown complete" in log and "Traceback" not in log


def test_a_model_that_fails_to_load_stops_the_server_with_status_1(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  s = ServerProcess(tmp_path, tmp_path / "server.log")
  assert s.proc.wait(120) == 1
  assert "loading the model failed" in s.log() and "unsupported architecture" in s.log()
  s.stop()


def test_serve_without_the_serve_extra_says_what_to_install():
  code = "import sys; sys.modules['uvicorn'] = None; from tinyvllm.cli import main; sys.exit(main(['serve', '--model', 'x']))"
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2 and "pip install -e '.[serve]'" in out.stderr and "uvicorn" in out.stderr
