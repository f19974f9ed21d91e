"""Tool calling, chat templates and the reasoning parser through a real server, with the official `openai` client: a
random-weight Qwen3 with the real Qwen3 tokenizer and chat template (../shared), served with --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3 --trust-request-chat-template.

A random model writes no tool call of its own accord: "required" and a named function are forced by the grammar (the
arguments then parse and validate against the function's parameters, which only the grammar makes true); "auto" and
the reasoning split are forced through a structured-output choice of a reference text. The parsers themselves are
tested on reference outputs in tests/test_tool_parsers.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess
from tests.test_tokenizer import QWEN3

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

MODEL = "tiny-qwen3"
# a tiny Qwen3 with the real vocabulary (random weights: --load-format dummy)
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 151936, "max_position_embeddings": 2048,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
          "bos_token_id": 151643, "eos_token_id": 151645}
# parameters a random model can only satisfy under the grammar, and must finish quickly (enums, a bounded integer)
WEATHER = {"type": "function", "function": {
  "name": "get_weather", "description": "The weather in a city",
  "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "東京"]},
                                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                 "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
  "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                                     "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
CONVERSATION = [  # a finished round of calls, as an OpenAI client sends it back (arguments as JSON strings)
  {"role": "system", "content": "You help."}, *USER,
  {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}},
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"CET\"}"}}]},
  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
  {"role": "tool", "tool_call_id": "call_2", "content": "14:00"}]


@pytest.fixture(scope="module")
def model_dir(shared_data: Path, tmp_path_factory) -> Path:
  folder = tmp_path_factory.mktemp("model") / "tiny-qwen3"
  shutil.copytree(shared_data / QWEN3, folder, ignore=shutil.ignore_patterns("derived"))
  (folder / "config.json").write_text(json.dumps(CONFIG))
  return folder


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, data_parallel_size):
  with ServerProcess(model_dir, tmp_path_factory.mktemp("log") / "server.log", "--load-format", "dummy", "--served-model-name",
                     MODEL, "--num-gpu-blocks", "96", "--max-model-len", "1024", "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--trust-request-chat-template",
                     "--data-parallel-size", str(data_parallel_size)) as s:
    yield s


@pytest.fixture(scope="module")
def client(server): return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(model_dir): return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def hf_ids(hf, messages: list[dict], **kwargs) -> list[int]:
  """The reference: transformers renders the chat (tool-call arguments as objects, as its templates expect), then
  tokenizes it."""
  for m in messages:
    for call in m.get("tool_calls") or []: call["function"]["arguments"] = json.loads(call["function"]["arguments"])
  return hf(hf.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)["input_ids"]


def tokenize(server, **body) -> httpx.Response:
  return httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body}, timeout=60)


def valid_arguments(name: str, arguments: str) -> bool:
  """The arguments parse as JSON and match the function's parameters (the schemas here: required enums and bounds)."""
  schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
  args = json.loads(arguments)
  if set(args) != set(schema["required"]): return False
  for key, value in args.items():
    rule = schema["properties"][key]
    if "enum" in rule and value not in rule["enum"]: return False
    if rule.get("type") == "integer" and not (isinstance(value, int) and rule["minimum"] <= value <= rule["maximum"]): return False
  return True


def streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, str]], str | None, list]:
  """(content, [(name, arguments)], finish_reason, tool-call deltas) of a streamed chat, assembled as a client does;
  the reasoning streamed, if any, is the deltas list's first item."""
  content, calls, finish, deltas, reasoning = None, {}, None, [], ""
  for chunk in client.chat.completions.create(stream=True, **kwargs):
    for choice in chunk.choices:
      delta = choice.delta
      reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
      if delta.content: content = (content or "") + delta.content
      for d in delta.tool_calls or []:
        deltas.append(d)
        if d.id is not None: calls[d.index] = [d.function.name, d.function.arguments or ""]
        else: calls[d.index][1] += d.function.arguments
      finish = choice.finish_reason or finish
  return content, [tuple(c) for _, c in sorted(calls.items())], finish, [reasoning, *deltas]


@pytest.mark.slow
def test_tools_reach_qwen3s_template_as_transformers_renders_them(server, hf):
  """The tools, an assistant turn of tool calls (arguments as JSON strings) and the tool results render as
  transformers' apply_chat_template renders them (Qwen3's real template); chat's prompt is that rendering."""
  for messages, kwargs in ((USER, {}), (CONVERSATION, {}), (CONVERSATION, {"enable_thinking": False})):
    ours = tokenize(server, messages=messages, tools=TOOLS, **({"chat_template_kwargs": kwargs} if kwargs else {})).json()
    assert ours["tokens"] == hf_ids(hf, json.loads(json.dumps(messages)), tools=TOOLS, add_generation_prompt=True, **kwargs)
  r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                 json={"model": MODEL, "messages": CONVERSATION, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})
  assert r.json()["usage"]["prompt_tokens"] == len(hf_ids(hf, json.loads(json.dumps(CONVERSATION)), tools=TOOLS,
                                                         add_generation_prompt=True))


# with --reasoning-parser the grammar starts after the reasoning, which a random model never ends: these requests turn
# thinking off, so that Qwen3's template closes the (empty) reasoning in the prompt and the grammar holds from the start
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.slow
def test_required_calls_round_trip_whole_and_streamed(client):
  """tool_choice "required": the grammar makes the output calls of the given tools whose arguments validate; the stream
  gives the same calls, each named first with its id, then its argument fragments."""
  kwargs = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120, "seed": 7,
            "extra_body": NO_THINKING}
  r = client.chat.completions.create(**kwargs)
  message, finish = r.choices[0].message, r.choices[0].finish_reason
  calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
  assert finish == "tool_calls" and calls and message.content is None
  assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
  assert all(valid_arguments(name, args) for name, args in calls), calls
  content, stream_calls, stream_finish, (reasoning, *deltas) = streamed(client, **kwargs)
  assert (content, reasoning, stream_calls, stream_finish) == (None, "", calls, "tool_calls")
  firsts = [d for d in deltas if d.id is not None]
  assert [d.index for d in firsts] == list(range(len(calls))) and all(d.type == "function" and d.id.startswith("call_") for d in firsts)
  assert all(d.function.name is None for d in deltas if d.id is None)


@pytest.mark.slow
def test_a_named_function_round_trips_whole_and_streamed(client):
  choice = {"type": "function", "function": {"name": "get_weather"}}
  kwargs = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": 60, "seed": 3,
            "extra_body": NO_THINKING}
  r = client.chat.completions.create(**kwargs)
  (call,) = r.choices[0].message.tool_calls
  assert call.function.name == "get_weather" and valid_arguments("get_weather", call.function.arguments), call
  assert r.choices[0].finish_reason == "stop"   # OpenAI's and vLLM's for a named function
  _, stream_calls, finish, _ = streamed(client, **kwargs)
  assert (stream_calls, finish) == ([("get_weather", call.function.arguments)], "stop")


@pytest.mark.slow
def test_a_forced_call_waits_for_the_reasoning_to_end(client):
  """Thinking on: the grammar of a required call starts after </think> (vLLM's), so the model writes freely first; a
  random model never ends its reasoning, so within max_tokens it writes no call (with thinking off, the tests above,
  the grammar makes one from the first token)."""
  r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=12,
                                     temperature=0)
  assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


CALL_TEXT = ('<think>\nThe user wants the weather.\n</think>\n\nI will check.\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "東京", "days": 2}}\n</tool_call>')


@pytest.mark.slow
def test_auto_reads_the_calls_the_model_writes(client):
  """tool_choice "auto" with a model that writes a call (forced here by a structured-output choice of the reference
  text): reasoning, content and the call come apart, whole and streamed (its arguments fragment by fragment), with
  finish_reason tool_calls."""
  kwargs = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 80,
            "extra_body": {"structured_outputs": {"choice": [CALL_TEXT]}, **NO_THINKING}}
  r = client.chat.completions.create(**kwargs)
  message = r.choices[0].message
  assert (message.content, message.model_extra["reasoning_content"]) == ("I will check.", "The user wants the weather.")
  assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("get_weather", {"city": "東京", "days": 2})]
  assert r.choices[0].finish_reason == "tool_calls"
  content, calls, finish, (reasoning, *deltas) = streamed(client, **kwargs)
  assert (content, reasoning, calls, finish) == \
    ("I will check.", "The user wants the weather.", [("get_weather", message.tool_calls[0].function.arguments)], "tool_calls")
  # the arguments are streamed as the model writes them, not in one piece once the call is complete
  assert len([d for d in deltas if d.id is None and d.function.arguments]) > 1


@pytest.mark.slow
def test_auto_without_a_call_is_text(client):
  r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=6, temperature=0,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
  choice = r.choices[0]
  assert not choice.message.tool_calls and choice.message.model_extra["reasoning_content"] is None
  assert choice.finish_reason == "length" and choice.message.content


@pytest.mark.slow
def test_a_request_template_and_continue_final_message(server, hf):
  template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
  r = tokenize(server, messages=USER, chat_template=template).json()
  assert r["tokens"] == hf(f"[user] {USER[0]['content']}\n[assistant]", add_special_tokens=False)["input_ids"]
  partial = [*USER, {"role": "assistant", "content": "The weather in Paris is"}]
  r = tokenize(server, messages=partial, continue_final_message=True, add_generation_prompt=False).json()
  assert r["tokens"] == hf_ids(hf, partial, continue_final_message=True, add_generation_prompt=False)
  chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
    "model": MODEL, "messages": partial, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2,
    "chat_template": template}).json()
  assert chat["usage"]["prompt_tokens"] == len(hf(f"[user] {USER[0]['content']}\n[assistant] The weather in Paris is",
                                                  add_special_tokens=False)["input_ids"])


BAD = [
  ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice", "get_stock"),
  ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
  ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
  ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "tools.0.function.name"),
  ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", "Input should be 'function'"),
  ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}, "tools", "parameters"),
  ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]}, "tools", "strict"),
  ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
   "tools", "is not valid"),
  ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
  ({"chat_template": "{% for %}"}, "chat_template", "does not parse"),
  ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
  ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
   "messages", "not valid JSON"),
]


@pytest.mark.slow
def test_bad_tool_requests_are_400s_naming_the_field_and_the_server_serves_on(server):
  with httpx.Client(base_url=server.url, timeout=300) as http:
    for fields, param, words in BAD:
      r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2, **fields})
      assert r.status_code == 400, (fields, r.text)
      error = r.json()["error"]
      assert error["param"] == param and words in error["message"], (fields, error)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
