"""Nothing a request asks for is silently ignored: every field of OpenAI's and vLLM's request shapes that the server
does not implement is a 400 naming it (a value asking for the default behaviour is accepted and changes nothing), and
a field in no shape is a 400 as OpenAI's server answers it.

The field lists are the APIs' own: the OpenAI client's request types (the installed `openai` package) and vLLM's
protocol (CompletionRequest, ChatCompletionRequest, TokenizeRequest, old and new fields), written out here with a value that
asks for something."""
from __future__ import annotations

import httpx
import pytest

from tests.server_process import ServerProcess, model_with_chat_template

MODEL = "stories"
CMPL, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
GOOD_CMPL = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}

# what the server implements (tests/test_server.py, tests/test_server_errors.py and tests/test_server_prompt_logprobs.py
# exercise them)
IMPLEMENTED_OPENAI_COMPLETION = {"model", "prompt", "echo", "frequency_penalty", "logprobs", "max_tokens", "n", "presence_penalty",
                                 "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user", "best_of", "logit_bias"}
IMPLEMENTED_OPENAI_CHAT = {"messages", "model", "frequency_penalty", "logprobs", "max_completion_tokens", "max_tokens", "n",
                           "parallel_tool_calls", "presence_penalty", "prompt_cache_key", "safety_identifier", "seed", "stop",
                           "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
                           "logit_bias", "response_format"}

# OpenAI's request fields the server does not implement, each with a value that asks for the feature
OPENAI_COMPLETION = {"suffix": " The end."}
OPENAI_CHAT = {
  "audio": {"voice": "alloy", "format": "wav"}, "function_call": {"name": "get_weather"},
  "functions": [{"name": "get_weather", "parameters": {}}], "metadata": {"run": "7"},
  "modalities": ["text", "audio"], "moderation": {"model": "omni-moderation-latest"},
  "prediction": {"type": "content", "content": "Once upon a time"}, "prompt_cache_options": {"mode": "explicit"},
  "prompt_cache_retention": "24h", "reasoning_effort": "low",
  "service_tier": "flex", "store": True, "verbosity": "low", "web_search_options": {"search_context_size": "low"},
}
# vLLM's extra sampling and request fields (both endpoints) the server does not implement
VLLM_COMMON = {
  "spaces_between_special_tokens": False, "truncate_prompt_tokens": 4, "truncation_side": "left",
  "logprob_token_ids": [5], "guided_decoding_backend": "xgrammar", "logits_processors": ["m.P"],
  "return_tokens_as_token_ids": True, "return_token_offsets": True, "cache_salt": "s4lt",
  "kv_transfer_params": {"do_remote_decode": True}, "ec_transfer_params": {"x": 1},
  "repetition_detection": {"max_pattern_size": 4}, "thinking_token_budget": 16, "mm_processor_kwargs": {"size": 2},
  "media_io_kwargs": {"image": {"mode": "RGB"}},
}
VLLM_COMPLETION = {**VLLM_COMMON, "prompt_embeds": "AAAA"}
VLLM_CHAT = {**VLLM_COMMON, "echo": True}
VLLM_TOKENIZE = {"mm_processor_kwargs": {"size": 2}, "return_token_strs": True}

REFUSED = ([(CMPL, GOOD_CMPL, field, {field: value}) for field, value in {**OPENAI_COMPLETION, **VLLM_COMPLETION}.items()]
           + [(CHAT, GOOD_CHAT, field, {field: value}) for field, value in {**OPENAI_CHAT, **VLLM_CHAT}.items()]
           + [(TOKENIZE, {"messages": GOOD_CHAT["messages"]}, field, {field: value}) for field, value in VLLM_TOKENIZE.items()]
           + [(CMPL, {**GOOD_CMPL, "stream": True}, "stream_options", {"stream_options": {"include_usage": True, **extra}})
              for extra in ({"continuous_usage_stats": True}, {"include_obfuscation": True})])

# values that ask for exactly the default behaviour (clients send some of these unasked): accepted, nothing changes
DEFAULTS_CMPL = {"best_of": 1, "logit_bias": {}, "suffix": None, "response_format": {"type": "text"}, "min_tokens": 0, "priority": 0,
                 "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True, "guided_json": None,
                 "bad_words": [], "return_token_ids": False, "vllm_xargs": {}, "thinking_token_budget": -1}
DEFAULTS_CHAT = {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "functions": [], "function_call": "none",
                 "response_format": {"type": "text"}, "modalities": ["text"], "service_tier": "auto", "store": False,
                 "metadata": {}, "logit_bias": {"5": 0}, "prompt_cache_retention": "in_memory", "verbosity": "medium",
                 "include_reasoning": True, "echo": False, "continue_final_message": False, "audio": None}
ACCEPTED = ([(CMPL, GOOD_CMPL, {field: value}) for field, value in DEFAULTS_CMPL.items()]
            + [(CMPL, GOOD_CMPL, {"n": 2, "best_of": 2, "temperature": 0}), (CMPL, GOOD_CMPL, DEFAULTS_CMPL)]
            + [(CHAT, GOOD_CHAT, {field: value}) for field, value in DEFAULTS_CHAT.items()]
            + [(CHAT, GOOD_CHAT, {"tools": [], "tool_choice": "auto"}), (CHAT, GOOD_CHAT, DEFAULTS_CHAT)])


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory, data_parallel_size):
  model = model_with_chat_template(stories_dir, tmp_path_factory.mktemp("model") / "stories-chat")
  with ServerProcess(model, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", MODEL, "--num-gpu-blocks", "64",
                     "--data-parallel-size", str(data_parallel_size)) as s:
    yield s


@pytest.fixture(scope="module")
def http(server):
  with httpx.Client(base_url=server.url, timeout=120) as c: yield c


@pytest.fixture(scope="module")
def baseline(http) -> dict[str, list]:
  """The greedy choices of the plain requests, which a default-valued field must not change."""
  return {path: [(c.get("text"), c.get("message"), c["finish_reason"]) for c in http.post(path, json=body).json()["choices"]]
          for path, body in ((CMPL, GOOD_CMPL), (CHAT, GOOD_CHAT))}


def test_every_field_of_the_openai_shapes_is_implemented_or_refused():
  """The OpenAI client's own request types list no field that this file neither knows as implemented nor sends."""
  from openai.types import completion_create_params
  from openai.types.chat import completion_create_params as chat_create_params
  completion = set(completion_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
  chat = set(chat_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
  assert completion == IMPLEMENTED_OPENAI_COMPLETION | set(OPENAI_COMPLETION)
  assert chat == IMPLEMENTED_OPENAI_CHAT | set(OPENAI_CHAT)


def assert_refused(r: httpx.Response, param: str, needle: str) -> None:
  assert r.status_code == 400, f"{param}: {r.status_code} {r.text}"
  err = r.json()["error"]
  assert err["param"] == param and err["type"] == "invalid_request_error" and needle in err["message"], err


@pytest.mark.parametrize("path,good,param,fields", REFUSED,
                         ids=[f"{path.rsplit('/', 1)[-1]}-{param}-{next(iter(fields))}" for path, _, param, fields in REFUSED])
def test_an_unimplemented_field_is_a_400_naming_it(http, path, good, param, fields):
  r = http.post(path, json={**fields, **good})
  assert_refused(r, param, "is not supported")
  assert r.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("path,good,fields", ACCEPTED, ids=[f"{p.rsplit('/', 1)[-1]}-{'+'.join(f)}"[:60] for p, _, f in ACCEPTED])
def test_a_default_value_is_accepted_and_changes_nothing(http, baseline, path, good, fields):
  r = http.post(path, json={**good, **fields})
  assert r.status_code == 200, r.text
  choices = [(c.get("text"), c.get("message"), c["finish_reason"]) for c in r.json()["choices"]]
  assert choices == baseline[path] * len(choices)


UNKNOWN = [(CMPL, GOOD_CMPL, "max_token"), (CMPL, GOOD_CMPL, "tools"), (CHAT, GOOD_CHAT, "prompt"), (CHAT, GOOD_CHAT, "suffix"),
           (TOKENIZE, {"prompt": "hi"}, "add_bos"), (DETOKENIZE, {"tokens": [1, 2]}, "skip_special_tokens")]


@pytest.mark.parametrize("path,good,field", UNKNOWN, ids=[f"{p.rsplit('/', 1)[-1]}-{f}" for p, _, f in UNKNOWN])
def test_an_unknown_field_is_a_400_as_openai_answers_it(http, path, good, field):
  r = http.post(path, json={**good, field: 1})
  assert_refused(r, field, f"Unrecognized request argument supplied: {field}")


def test_unknown_nested_fields_and_combinations_are_refused(http):
  r = http.post(CMPL, json={**GOOD_CMPL, "stream": True, "stream_options": {"include_usage": True, "bogus": 1}})
  assert_refused(r, "stream_options", "Unrecognized request argument supplied: stream_options.bogus")
  assert_refused(http.post(CHAT, json={**GOOD_CHAT, "stream_options": {"include_usage": True}}), "stream_options", "stream: true")
  assert_refused(http.post(CMPL, json={**GOOD_CMPL, "stream": True, "prompt_logprobs": 1}), "prompt_logprobs", "stream")
  assert_refused(http.post(CHAT, json={**GOOD_CHAT, "stream": True, "prompt_logprobs": 0}), "prompt_logprobs", "stream")
  r = http.post(CHAT, json={**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]})
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_priority_under_fcfs_is_a_400_naming_it(http, baseline):
  """priority is implemented (tests/test_server_priority.py); this server schedules fcfs, which cannot honour one."""
  for path, good in ((CMPL, GOOD_CMPL), (CHAT, GOOD_CHAT)):
    assert_refused(http.post(path, json={**good, "priority": 1}), "priority", "scheduling_policy='priority'")
    assert_refused(http.post(path, json={**good, "priority": "1"}), "priority", "")


def test_cheap_vllm_extras_are_implemented(http, baseline):
  """request_id names the response; add_special_tokens decides the tokenizer's BOS (its default differs per endpoint);
  user, safety_identifier and prompt_cache_key identify the caller and change no output."""
  r = http.post(CMPL, json={**GOOD_CMPL, "request_id": "my-run-7"}).json()
  assert r["id"] == "cmpl-my-run-7"
  assert http.post(CHAT, json={**GOOD_CHAT, "request_id": "my-run-7"}).json()["id"] == "chatcmpl-my-run-7"
  bare = http.post(TOKENIZE, json={"prompt": GOOD_CMPL["prompt"], "add_special_tokens": False}).json()["count"]
  with_bos = http.post(CMPL, json=GOOD_CMPL).json()["usage"]["prompt_tokens"]
  assert http.post(CMPL, json={**GOOD_CMPL, "add_special_tokens": False}).json()["usage"]["prompt_tokens"] == bare == with_bos - 1
  chat_tokens = http.post(CHAT, json=GOOD_CHAT).json()["usage"]["prompt_tokens"]
  assert http.post(CHAT, json={**GOOD_CHAT, "add_special_tokens": True}).json()["usage"]["prompt_tokens"] == chat_tokens + 1
  ids = {"user": "u-1", "safety_identifier": "h-2", "prompt_cache_key": "k-3"}
  r = http.post(CHAT, json={**GOOD_CHAT, **ids})
  assert [(c.get("text"), c.get("message"), c["finish_reason"]) for c in r.json()["choices"]] == baseline[CHAT]


def test_tool_calling_and_request_templates_need_the_servers_flags(http, baseline):
  """vLLM's rules on a server started without them: tool_choice "auto" (the default beside tools) needs
  --enable-auto-tool-choice and --tool-call-parser; a request's chat_template needs --trust-request-chat-template;
  include_reasoning: false needs --reasoning-parser.
  tool_choice "none" still works (the tools reach the template, the output is text)."""
  assert_refused(http.post(CHAT, json={**GOOD_CHAT, "tools": [TOOL]}), "tool_choice", "--enable-auto-tool-choice")
  assert_refused(http.post(CHAT, json={**GOOD_CHAT, "tools": [TOOL], "tool_choice": "auto"}), "tool_choice", "--tool-call-parser")
  for path, good in ((CHAT, GOOD_CHAT), (TOKENIZE, {"messages": GOOD_CHAT["messages"]})):
    assert_refused(http.post(path, json={**good, "chat_template": "{{ messages }}"}), "chat_template", "--trust-request-chat-template")
  assert_refused(http.post(CHAT, json={**GOOD_CHAT, "include_reasoning": False}), "include_reasoning", "--reasoning-parser")
  r = http.post(CHAT, json={**GOOD_CHAT, "tools": [TOOL], "tool_choice": "none"})
  assert r.status_code == 200 and not r.json()["choices"][0]["message"]["tool_calls"]
