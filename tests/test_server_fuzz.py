"""A bounded fuzz of the server (a few hundred requests, about a minute): malformed JSON, deep nesting, huge numbers,
wrong types, extreme floats, wrong content types and hosts, and random field combinations to both generation
endpoints, on one kept-alive connection: never a 5xx, every 4xx in OpenAI's shape, the connection still serves the next
request; then lying and oversized bodies, half-sent heads and garbage on connections of their own: an answer in
OpenAI's shape within the deadlines. Afterwards the log has no traceback and every KV block is free."""
from __future__ import annotations

import json
import random
import time
from collections import Counter

import httpx
import pytest

from tests.raw_http import RawConnection, read_until_closed, status_and_json
from tests.server_process import ServerProcess, model_with_chat_template
from tests.test_server_errors import metrics

pytestmark = pytest.mark.slow
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}
HEADER_TIMEOUT, BODY_TIMEOUT = 1.0, 1.0


class Raw(str):
  """A JSON literal written as it is (numbers json.dumps cannot write, nesting deeper than it allows)."""


def dump(value) -> str:
  if isinstance(value, Raw): return str(value)
  if isinstance(value, dict): return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
  if isinstance(value, list): return "[" + ",".join(dump(v) for v in value) + "]"
  return json.dumps(value)


def deep(depth: int) -> Raw: return Raw("[" * depth + "]" * depth)


ODD_VALUES = [None, True, False, 0, -1, 1, 2, 5, 1 << 31, 1 << 63, 1 << 64, -(1 << 63) - 1, 10 ** 30, Raw("9" * 5000),
              0.0, -0.0, 0.5, 1e-300, 5e-324, 1e-38, 1.1e-38, 3.4e38, 3.5e38, 1e308, -1e308, Raw("1e400"), Raw("-1e999"),
              "", "x", "Once upon a time", "\u0000", "😀", [], [1, 2], [[1]], ["a"], [""], [None], {}, {"a": 1},
              {"include_usage": True}, deep(30), deep(250), deep(5000)]
COMPLETION_FIELDS = ["model", "prompt", "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "max_tokens", "stop", "stop_token_ids", "ignore_eos",
                     "include_stop_str_in_output", "skip_special_tokens", "logprobs", "prompt_logprobs", "echo", "stream",
                     "stream_options", "add_special_tokens", "user", "request_id", "priority", "logit_bias", "suffix",
                     "best_of", "min_tokens", "no_such_field"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "suffix", "logprobs")] + [
  "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt", "chat_template_kwargs",
  "documents", "tools", "response_format"]
GOOD_VALUES = {"n": [1, 2, 3], "temperature": [0, 0.7, 1.0, 1e-5, 1e-30], "top_p": [1e-30, 0.5, 1.0], "top_k": [-1, 0, 1, 5, 10 ** 6],
               "min_p": [0, 0.1, 1.0], "seed": [0, -5, (1 << 64) - 1], "presence_penalty": [-2, 0, 2],
               "repetition_penalty": [0.01, 1.3, 100], "max_tokens": [1, 2, 4], "stop": ["a", ["the", "."]],
               "stop_token_ids": [[1, 2]], "logprobs": [0, 2], "prompt_logprobs": [0, 1], "echo": [True],
               "stream": [True, False], "ignore_eos": [True], "priority": [0], "user": ["u1"],
               "prompt": ["Once upon a time", ["Tim", "Zoo"], [1, 200, 300], [[1, 5], [1, 9]]],
               "messages": [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"},
                                                                   {"role": "user", "content": [{"type": "text", "text": "go"}]}]]}


def random_body(rng: random.Random, chat: bool) -> bytes:
  """A valid request with a few fields changed to good or odd values, or dropped; sometimes broken as text."""
  body: dict = {"max_tokens": rng.randint(1, 3), "temperature": 0}
  body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Once upon a time"})
  for field in rng.sample(CHAT_FIELDS if chat else COMPLETION_FIELDS, rng.randint(0, 4)):
    roll = rng.random()
    if roll < 0.1: body.pop(field, None)
    elif roll < 0.55 and field in GOOD_VALUES: body[field] = rng.choice(GOOD_VALUES[field])
    else: body[field] = rng.choice(ODD_VALUES)
  text = dump(body).encode()
  roll = rng.random()
  if roll < 0.05: return text[:rng.randrange(len(text))]                          # cut short
  if roll < 0.08: return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))   # noise
  if roll < 0.10: return dump(rng.choice(ODD_VALUES)).encode()                   # not an object
  return text


def random_headers(rng: random.Random, port: int) -> dict[str, str]:
  headers = dict(JSON)
  roll = rng.random()
  if roll < 0.06: headers["content-type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                                        "application/xml", "text/plain; charset=utf-8", ""])
  elif roll < 0.09: headers["host"] = rng.choice(["evil.example", f"evil.example:{port}", "[::2]:80", "localhost.evil", "127.0.0.2"])
  elif roll < 0.12: headers["content-type"] = "application/json; charset=utf-8"
  elif roll < 0.14: headers["host"] = rng.choice([f"localhost:{port}", "[::1]", "LOCALHOST"])
  return headers


def check_answer(r, context: str) -> None:
  """Never a 5xx; a 4xx in OpenAI's shape; a 200 a whole response or stream with no error in it."""
  assert r.status < 500, f"{context}: {r.status} {r.body[:300]!r}"
  if r.status >= 400:
    err = r.json()
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, context
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"], context
  elif r.headers.get("content-type", "").startswith("text/event-stream"):
    events = [line[6:] for line in r.body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events[:-1]), f"{context}: {r.body[-300:]!r}"
  else:
    assert r.status == 200 and r.json()["choices"], context


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
  model = model_with_chat_template(stories_dir, tmp_path_factory.mktemp("model") / "stories")
  log = tmp_path_factory.mktemp("log") / "server.log"
  with ServerProcess(model, log, "--served-model-name", "stories", "--num-gpu-blocks", "128", "--header-timeout",
                     str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT), "--max-seqs-per-request", "16") as s:
    yield s


def test_random_requests_on_one_connection(server):
  rng, conn = random.Random(0), RawConnection(server.port)
  probe = json.dumps({"prompt": "Once upon a time"}).encode()
  expected = conn.request("POST", "/tokenize", probe, JSON).json()
  sent, statuses = 0, Counter()
  try:
    for i in range(400):
      chat = i % 2 == 1
      body, headers = random_body(rng, chat), random_headers(rng, server.port)
      r = conn.request("POST", CHAT if chat else CMPL, body, headers)
      check_answer(r, f"request {i}: {body[:200]!r} {headers}")
      statuses[r.status] += 1
      assert conn.reusable, f"request {i} ({r.status}) closed the connection: {body[:200]!r}"
      follow = conn.request("POST", "/tokenize", probe, JSON)   # the same connection serves the next request
      assert follow.status == 200 and follow.json() == expected and conn.reusable, f"after request {i}"
      sent += 2
  finally:
    conn.close()
  assert sent == 800   # within the bound of 2,000 requests
  assert statuses[200] >= 80 and statuses[400] >= 80 and statuses[415] >= 5, statuses   # both kinds of answer, often


LYING = [
  ("declared 10^19 bytes, 30 sent", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                    b"Content-Length: 10000000000000000000\r\n\r\n" + b"{" * 30, 413, 1.0),
  # a length of more than 20 digits is past what the HTTP parser (h11) takes: a malformed request
  ("declared 10^20 bytes, 30 sent", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                    b"Content-Length: 100000000000000000000\r\n\r\n" + b"{" * 30, 400, 1.0),
  ("declared 5 MiB, none sent", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 5242880\r\n\r\n", 413, 1.0),
  ("declared 100 bytes, 30 sent", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 100\r\n\r\n" + b'{"prompt": "Once upon a time",', 408, BODY_TIMEOUT + 2),
  ("half-sent head", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty", 408, HEADER_TIMEOUT + 2),
  ("garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n", 400, 1.0),
  ("non-numeric Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n{}", 400, 1.0),
  ("broken chunked body", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, 1.0),
]


@pytest.mark.parametrize("raw,status,within", [c[1:] for c in LYING], ids=[c[0] for c in LYING])
def test_lying_and_broken_requests_are_answered_in_time(server, raw, status, within):
  conn = RawConnection(server.port)
  try:
    conn.send_raw(raw)
    data, took = read_until_closed(conn.sock, within + 5)
  finally:
    conn.close()
  got, body = status_and_json(data)
  assert got == status and took < within, (data[:300], took)
  assert body is not None and set(body["error"]) == {"message", "type", "param", "code"}


def test_an_idle_connection_is_closed_without_an_answer(server):
  conn = RawConnection(server.port)
  try: data, took = read_until_closed(conn.sock, HEADER_TIMEOUT + 5)
  finally: conn.close()
  assert data == b"" and took < HEADER_TIMEOUT + 2


def test_a_longer_body_than_declared_is_two_answers(server):
  """Content-Length 10 with 30 bytes: the first 10 are the body (not JSON: a 400), the rest is a malformed request (a
  400, and the connection closes)."""
  conn = RawConnection(server.port)
  head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n"
  try:
    conn.send_raw(head + b'{"prompt": "Once upon a time"}')
    data, _ = read_until_closed(conn.sock, 10)
  finally:
    conn.close()
  assert data.count(b"HTTP/1.1 400 ") == 2 and data.count(b'"type":"invalid_request_error"') == 2, data


def test_afterwards_nothing_is_held_and_the_log_has_no_traceback(server):
  r = httpx.post(f"{server.url}{CMPL}", json={"prompt": "Once upon a time", "max_tokens": 2}, timeout=120)
  assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0
  deadline = time.monotonic() + 30
  while (m := metrics(server))["tinyvllm:num_requests_running"] or m["tinyvllm:kv_cache_blocks_used"]:
    assert time.monotonic() < deadline, m
    time.sleep(0.1)
  assert httpx.get(f"{server.url}/health").status_code == 200
  log = server.log()
  assert "Traceback" not in log and "Exception in ASGI" not in log and "internal error" not in log
