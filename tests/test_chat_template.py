"""Chat templates: Qwen3's renders against the recorded references and transformers, jinja features, errors."""
from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.test_tokenizer import QWEN3, tokenizer_at
from tinyvllm.tokenizer import Tokenizer, TokenizerError, load_tokenizer

WEATHER_TOOL = {"type": "function", "function": {
  "name": "get_weather", "description": "Météo actuelle — current weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市"}},
                 "required": ["city"]}}}

CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
  ([{"role": "user", "content": "Hi there"}], {}),
  ([{"role": "user", "content": "Hi there"}], {"add_generation_prompt": False}),
  ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}], {"enable_thinking": False}),
  ([{"role": "user", "content": "天气怎么样？"}], {"tools": [WEATHER_TOOL]}),
  ([{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Zürich and 東京?"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
      {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}}]},
    {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "{\"temp\": 25}"}],
   {"tools": [WEATHER_TOOL]}),
  ([{"role": "user", "content": "Why?"},
    {"role": "assistant", "content": "Because.", "reasoning_content": "The user asks why."}],
   {"add_generation_prompt": False}),
  ([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
    {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning": "thinking about Q2"}],
   {"add_generation_prompt": False}),
  ([{"role": "user", "content": "emoji 😀 and\nnewlines\n\n"}], {"enable_thinking": True}),
]


@pytest.fixture(scope="module")
def hf_qwen(shared_data: Path):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(str(shared_data / QWEN3))


def test_reference_renders(qwen: Tokenizer, shared_data: Path):
  ref = json.loads((shared_data / "tokenizers/qwen3/derived/reference_encodings.json").read_text())
  assert len(ref["chat_template_renders"]) >= 4
  for case in ref["chat_template_renders"]:
    kwargs = {"add_generation_prompt": case["add_generation_prompt"], "enable_thinking": case["enable_thinking"]}
    assert qwen.apply_chat_template(case["messages"], **kwargs) == case["rendered"]
    assert qwen.apply_chat_template(case["messages"], tokenize=True, **kwargs) == case["ids"]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_matches_transformers(qwen: Tokenizer, hf_qwen, index: int):
  messages, kwargs = CONVERSATIONS[index]
  kwargs = {"add_generation_prompt": True, **kwargs}
  expected = hf_qwen.apply_chat_template(messages, tokenize=False, **kwargs)
  assert qwen.apply_chat_template(messages, **kwargs) == expected
  assert qwen.apply_chat_template(messages, tokenize=True, **kwargs) == \
    hf_qwen(expected, add_special_tokens=False)["input_ids"]


def test_qwen25_template_matches_transformers(shared_data: Path, tmp_path: Path):
  transformers = pytest.importorskip("transformers")
  q3, q25 = shared_data / QWEN3, shared_data / "tokenizers/qwen2.5"
  for name in ("vocab.json", "merges.txt"):
    shutil.copy(q3 / name, tmp_path / name)
  shutil.copy(q25 / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ours = load_tokenizer(tmp_path)
  for messages, kwargs in CONVERSATIONS[:5]:
    kwargs = {"add_generation_prompt": True, **kwargs}
    assert ours.apply_chat_template(messages, **kwargs) == hf.apply_chat_template(messages, tokenize=False, **kwargs)


def _with_template(stories_dir: Path, tmp_path: Path, template: Any, jinja_file: str | None = None) -> Tokenizer:
  shutil.copy(stories_dir / "tokenizer.json", tmp_path / "tokenizer.json")
  config = json.loads((stories_dir / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
  if jinja_file is not None:
    (tmp_path / "chat_template.jinja").write_text(jinja_file)
  return load_tokenizer(tmp_path)


def test_bos_in_template_is_not_added_twice(stories_dir: Path, tmp_path: Path):
  tok = _with_template(stories_dir, tmp_path, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
  assert tok.apply_chat_template([{"role": "user", "content": "Zoo"}]) == "<s>Zoo"
  assert tok.apply_chat_template([{"role": "user", "content": "Zoo"}], tokenize=True) == [1, 410, 469, 347]


def test_named_templates_use_default(stories_dir: Path, tmp_path: Path):
  templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain {{ eos_token }}"}]
  assert _with_template(stories_dir, tmp_path, templates).apply_chat_template([]) == "plain </s>"


def test_jinja_file_wins(stories_dir: Path, tmp_path: Path):
  tok = _with_template(stories_dir, tmp_path, "from config", jinja_file="from file")
  assert tok.apply_chat_template([]) == "from file"


def test_hf_jinja_features(stories_dir: Path, tmp_path: Path):
  template = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
              "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
              "{% endfor %}{{ strftime_now('%Y') }}|{{ add_generation_prompt }}|{{ tools | tojson }}|{{ flag }}")
  tok = _with_template(stories_dir, tmp_path, template)
  messages = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "2"},
              {"role": "user", "content": "3"}]
  rendered = tok.apply_chat_template(messages, add_generation_prompt=False, tools=[{"name": "ü"}], flag=7)
  year = datetime.now().strftime("%Y")
  # trim_blocks drops the newline after "{% endgeneration %}"; tojson keeps non-ASCII and "<" as they are
  assert rendered == ('{"role": "user", "content": "héllo <b>"}{"role": "assistant", "content": "2"}'
                      f'{year}|False|[{{"name": "ü"}}]|7')


def test_template_raise_exception(stories_dir: Path, tmp_path: Path):
  tok = _with_template(stories_dir, tmp_path, "{{ raise_exception('only user turns, please') }}")
  with pytest.raises(TokenizerError, match="only user turns, please"):
    tok.apply_chat_template([])


def test_template_sandbox(stories_dir: Path, tmp_path: Path):
  tok = _with_template(stories_dir, tmp_path, "{% set ns = namespace(_x=1) %}{{ ns._x }}")
  with pytest.raises(TokenizerError):
    tok.apply_chat_template([])
  tok = _with_template(stories_dir, tmp_path, "{{ messages.__class__.__mro__ }}")
  with pytest.raises(TokenizerError):
    tok.apply_chat_template([])


def test_no_chat_template(shared_data: Path, stories_dir: Path):
  for tok in (tokenizer_at("models/stories260K-hf"), tokenizer_at("tokenizers/llama3")):
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
      tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("messages", [
  "hello", {"role": "user", "content": "hi"}, ["hello"], [{"content": "no role"}], [{"role": "user"}],
  [{"role": 3, "content": "hi"}], [{"role": "user", "content": 5}], [{"role": "user", "content": "ok"}, None],
])
def test_bad_messages(qwen: Tokenizer, messages: Any):
  with pytest.raises(TokenizerError, match="message"):
    qwen.apply_chat_template(messages)


def test_messages_are_not_modified(qwen: Tokenizer):
  messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": "r"}]
  copy = json.loads(json.dumps(messages))
  qwen.apply_chat_template(messages)
  assert messages == copy


CONTINUED = [
  [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}],
  [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, 3,  \n"}],   # trailing spacing
  [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"},
   {"role": "user", "content": "Again"}, {"role": "assistant", "content": "H"}],
]


@pytest.mark.parametrize("index", range(len(CONTINUED)))
def test_continue_final_message_matches_transformers(qwen: Tokenizer, hf_qwen, index: int):
  """The text stops inside the last message (no end of turn after it), as HF transformers cuts it."""
  messages = CONTINUED[index]
  kwargs = {"add_generation_prompt": False, "continue_final_message": True, "enable_thinking": False}
  expected = hf_qwen.apply_chat_template(messages, tokenize=False, **kwargs)
  assert qwen.apply_chat_template(messages, **kwargs) == expected
  assert not expected.endswith("<|im_end|>\n")


def test_continue_final_message_errors(qwen: Tokenizer):
  with pytest.raises(TokenizerError, match="add_generation_prompt"):
    qwen.apply_chat_template(CONTINUED[0], add_generation_prompt=True, continue_final_message=True)
  with pytest.raises(TokenizerError, match="text content"):
    qwen.apply_chat_template([{"role": "user", "content": None}], add_generation_prompt=False, continue_final_message=True)


def test_tool_call_arguments_given_as_json_strings_render_as_objects(qwen: Tokenizer, hf_qwen):
  """OpenAI's clients send a tool call's arguments as a JSON string; they reach the template as the object HF's
  templates expect (vLLM's rule), an empty string as {}; one that is not JSON is named."""
  from tinyvllm.tokenizer.chat_template import parse_tool_call_arguments
  as_strings = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}},
                  {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
  as_objects = json.loads(json.dumps(as_strings))
  as_objects[1]["tool_calls"][0]["function"]["arguments"] = {"city": "東京"}
  as_objects[1]["tool_calls"][1]["function"]["arguments"] = {}
  assert parse_tool_call_arguments(as_strings) == as_objects
  assert as_strings[1]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"東京\"}"   # the caller's messages stay
  expected = hf_qwen.apply_chat_template(as_objects, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
  assert qwen.apply_chat_template(parse_tool_call_arguments(as_strings), tools=[WEATHER_TOOL]) == expected
  as_strings[1]["tool_calls"][1]["function"]["arguments"] = "{city"
  with pytest.raises(TokenizerError, match="message 1: a tool call's arguments are not valid JSON"):
    parse_tool_call_arguments(as_strings)


def test_templates_given_per_call_are_kept_compiled_within_a_bound(qwen: Tokenizer):
  """A server that renders requests' own templates keeps the recently used ones compiled, not every one it ever saw."""
  from tinyvllm.tokenizer.tokenizer import OTHER_TEMPLATES
  chat = [{"role": "user", "content": "x"}]
  for i in range(OTHER_TEMPLATES + 10): assert qwen.apply_chat_template(chat, chat_template=f"{{{{ messages[0].content }}}}{i}") == f"x{i}"
  assert len(qwen._other_templates) == OTHER_TEMPLATES
