"""The chat output's parsers on reference outputs written here: Hermes/Qwen `<tool_call>` blocks and Llama-3's JSON calls
(several calls, malformed ones left as content), the JSON of forced calls (required, named), Qwen3's reasoning split, and
the three together. Each output is fed whole and in pieces of every size: a stream and a whole response agree."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from tinyvllm.entrypoints.chat_output import ChatOutputParser
from tinyvllm.entrypoints.chat_settings import ChatSettings
from tinyvllm.entrypoints.chat_tools import ToolPlan, plan_tools, required_schema
from tinyvllm.entrypoints.errors import APIError
from tinyvllm.entrypoints.protocol import ChatCompletionRequest
from tinyvllm.entrypoints.reasoning_parser import Qwen3ReasoningParser
from tinyvllm.entrypoints.tool_parsers import (
  HermesToolParser,
  Llama3JsonToolParser,
  NamedToolCall,
  RequiredToolCalls,
  ToolParser,
)

SIZES = (1, 2, 3, 5, 8, 13, 10_000)


def pieces(text: str, size: int) -> list[str]:
  return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def run(make: type[ToolParser] | object, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
  """(content, [(name, arguments)]) from feeding `text` in pieces of `size`; checks the deltas' OpenAI order on the way."""
  parser = make() if callable(make) else make
  content, calls = "", []
  chunks = pieces(text, size)
  for i, piece in enumerate(chunks):
    got, deltas = parser.feed(piece, i == len(chunks) - 1)
    content += got
    for d in deltas:
      if d.name is not None:
        assert d.index == len(calls) and d.id.startswith("call_") and d.arguments == ""
        calls.append([d.name, ""])
      else:
        assert d.index == len(calls) - 1   # arguments follow their call's name
        calls[-1][1] += d.arguments
  assert parser.calls == len(calls)
  return content, [tuple(c) for c in calls]


def triples(deltas) -> list[tuple]:
  """Deltas as (index, name, arguments)."""
  return [(d.index, d.name, d.arguments) for d in deltas]


def same_in_every_piece_size(make, text: str) -> tuple[str, list[tuple[str, str]]]:
  results = {size: run(make, text, size) for size in SIZES}
  assert all(r == results[SIZES[-1]] for r in results.values()), results
  return results[SIZES[-1]]


# what Qwen3 writes (its template asks for <tool_call> blocks, one JSON object each, on lines of their own)
HERMES_TWO_CALLS = ('Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/東京", "format": {"h24": true}}}\n</tool_call>')
HERMES_CASES = [
  (HERMES_TWO_CALLS, "Let me look both up.",
   [("get_weather", '{"city": "Zürich"}'), ("get_time", '{"zone": "Asia/東京", "format": {"h24": true}}')]),
  ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', "", [("ping", "{}")]),
  ('<tool_call>{"name": "ping"}</tool_call>', "", [("ping", "{}")]),                       # no arguments: an empty object
  ('Before <tool_call>{"name": "a", "arguments": {"x": [1, "</tool"]}}</tool_call> after',   # text on both sides stays
   "Before after", [("a", '{"x": [1, "</tool"]}')]),
  ('<tool_call>\n{"name": "ping", "arguments": {"n": 1}}', "", [("ping", '{"n": 1}')]),     # unclosed at the end (vLLM's)
  ("No tools needed: 2 < 3 and <tool is not a tag.\n", "No tools needed: 2 < 3 and <tool is not a tag.\n", []),
]
HERMES_MALFORMED = [
  '<tool_call>\n{"arguments": {"city": "Bern"}}\n</tool_call>',                        # no name
  '<tool_call>\n{"name": "f", "arguments": "city=Bern"}\n</tool_call>',                # arguments not an object
  '<tool_call>\n["f", {"city": "Bern"}]\n</tool_call>',                                # not an object
  '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}, 1\n</tool_call>',                # a call's keys, then more JSON
]
# blocks that open as a call does ({"name": ..., "arguments": {), so a stream gives the call before the rest shows
HERMES_MALFORMED_LATE = [
  ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zür\n</tool_call>', "get_weather", '{"city": "Zür\n'),  # cut
  ('<tool_call>\n{"name": "f", "arguments": {}, "extra": 1}\n</tool_call>', "f", "{}"),                    # a key no call has
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_reads_the_calls_and_keeps_the_text(text, content, calls):
  assert same_in_every_piece_size(HermesToolParser, text) == (content, calls)


@pytest.mark.parametrize("block", HERMES_MALFORMED)
def test_hermes_leaves_a_malformed_call_as_content(block):
  assert same_in_every_piece_size(HermesToolParser, block) == (block, [])
  # beside a good call, the good one is a call and the bad one stays as it was written
  good = '<tool_call>\n{"name": "ok", "arguments": {"a": 1}}\n</tool_call>'
  assert same_in_every_piece_size(HermesToolParser, f"{good}\n{block}") == (block, [("ok", '{"a": 1}')])


@pytest.mark.parametrize("block,name,streamed", HERMES_MALFORMED_LATE)
def test_a_block_that_opens_as_a_call_is_content_whole_and_a_call_once_streamed(block, name, streamed):
  """Whole (or in one piece), the block is the content it is; streamed, its call had left before the block went wrong,
  so it stands with the arguments' text as written (vLLM's streams do the same)."""
  assert run(HermesToolParser, block, 10_000) == (block, [])
  assert all(run(HermesToolParser, block, size) == ("", [(name, streamed)]) for size in SIZES[:-1])


def test_hermes_streams_a_calls_arguments_as_they_are_written():
  """Text is held back only while it could be the start of a call (or whitespace before one); a call is given once its
  block shows the name and the arguments object opening, then its arguments' text fragment by fragment."""
  parser = HermesToolParser()
  assert parser.feed("Sure", False) == ("Sure", [])
  assert parser.feed(", one moment.\n<tool", False) == (", one moment.", [])
  assert parser.feed('_call>\n{"name": "get_wea', False) == ("", [])
  content, deltas = parser.feed('ther", "arguments": {"ci', False)
  assert content == "" and triples(deltas) == [(0, "get_weather", ""), (0, None, '{"ci')]
  assert triples(parser.feed('ty": "Bern", "n": [1, "}"]}', False)[1]) == \
    [(0, None, 'ty": "Bern", "n": [1, "}"]}')]   # the object ends at its own closing brace, not the one in a string
  assert parser.feed("}\n</tool_", False) == ("", [])
  assert parser.feed("call>\n", True) == ("", [])
  assert parser.calls == 1


def test_arguments_never_take_a_piece_of_the_closing_tag():
  parser = HermesToolParser()
  _, deltas = parser.feed('<tool_call>{"name": "f", "arguments": {"a": "x</tool', False)
  assert [d.arguments for d in deltas] == ["", '{"a": "x']
  _, deltas = parser.feed("_call>", True)   # the block ends inside the string: cut, and already streamed
  assert deltas == [] and parser.calls == 1


LLAMA3_CASES = [
  ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
  ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
  ('<|python_tag|> {"name": "f", "parameters": {"a": "b"}}', [("f", '{"a": "b"}')]),
  ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}', [("a", '{"x": 1}'), ("b", '{"y": [2]}')]),
  (' {"name": "a", "parameters": {}}\n', [("a", "{}")]),
  # a call that does not open as the format has it is given when the output ends, after the ones streamed before it
  ('{"name": "a", "parameters": {"x": 1}}; {"parameters": {"y": 2}, "name": "b"}; {"name": "c"}',
   [("a", '{"x": 1}'), ("b", '{"y": 2}'), ("c", "{}")]),
]
LLAMA3_TEXT = ["The weather is fine.", '{"temperature": 21}', "<|python_tag|>print(1)", "{",
               '{"parameters": {"x": 1}, "name": "a"} and more words']
# outputs that open as a call does, so a stream gives the call before the rest shows: (text, streamed calls, content)
LLAMA3_LATE = [('{"name": "a", "parameters": {}} and more words', [("a", "{}")], "and more words"),
               ('{"name": "a", "parameters": {"x": 1}', [("a", '{"x": 1}')], "")]


@pytest.mark.parametrize("text,calls", LLAMA3_CASES)
def test_llama3_json_reads_the_calls(text, calls):
  assert same_in_every_piece_size(Llama3JsonToolParser, text) == ("", calls)


@pytest.mark.parametrize("text", LLAMA3_TEXT)
def test_llama3_json_leaves_anything_else_as_content(text):
  assert same_in_every_piece_size(Llama3JsonToolParser, text) == (text, [])


@pytest.mark.parametrize("text,calls,content", LLAMA3_LATE)
def test_llama3_json_output_that_opens_as_a_call_is_content_whole_and_calls_once_streamed(text, calls, content):
  assert run(Llama3JsonToolParser, text, 10_000) == (text, [])
  assert run(Llama3JsonToolParser, text, 1) == (content, calls)


def test_llama3_json_streams_each_calls_arguments_as_they_are_written():
  parser = Llama3JsonToolParser()
  assert parser.feed('<|python_tag|>{"name": "a", "param', False) == ("", [])
  _, deltas = parser.feed('eters": {"x": [1, "}"', False)
  assert triples(deltas) == [(0, "a", ""), (0, None, '{"x": [1, "}"')]
  _, deltas = parser.feed(']}}; {"name": "b", "arguments": {', False)
  assert triples(deltas) == [(0, None, "]}"), (1, "b", ""), (1, None, "{")]
  _, deltas = parser.feed("}}", True)
  assert triples(deltas) == [(1, None, "}")] and parser.calls == 2


def test_llama3_json_streams_plain_text_at_once():
  parser = Llama3JsonToolParser()
  assert parser.feed("  ", False) == ("", []) and parser.feed("Hi", False) == ("  Hi", []) and parser.feed("!", True) == ("!", [])


def test_required_reads_the_array_the_grammar_keeps_to():
  text = ('[{"name": "get_weather", "parameters": {"city": "Paris", "note": "a \\"}\\" in a string"}}, '
          '{"parameters": {"zone": "UTC"}, "name": "get_time"}, {"name": "ping", "parameters": {}}]')
  content, calls = same_in_every_piece_size(RequiredToolCalls, text)
  assert content == "" and [name for name, _ in calls] == ["get_weather", "get_time", "ping"]
  assert [json.loads(args) for _, args in calls] == [p["parameters"] for p in json.loads(text)]


def test_required_streams_the_arguments_as_they_come():
  parser = RequiredToolCalls()
  assert parser.feed('[{"name": "f', False) == ("", [])
  _, deltas = parser.feed('", "parameters": {"a"', False)
  assert triples(deltas) == [(0, "f", ""), (0, None, '{"a"')]
  _, deltas = parser.feed(': 1}}]', True)
  assert triples(deltas) == [(0, None, ": 1}")]


def test_a_named_call_is_the_whole_output():
  assert same_in_every_piece_size(lambda: NamedToolCall("get_weather"), '{"city": "Paris"}') == \
    ("", [("get_weather", '{"city": "Paris"}')])


QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
REASONING_CASES = [
  ("<think>\nThe user greets me.\n\nI greet back.\n</think>\n\nHello!", "The user greets me.\n\nI greet back.", "Hello!"),
  ("Hello without thinking.", "", "Hello without thinking."),
  ("<think>\n\n</think>\n\nHello!", "", "Hello!"),
  ("<think>\nCut before the end", "Cut before the end", ""),
  ("<thinking>is not the tag", "", "<thinking>is not the tag"),
  ("Text first <think>is not reasoning</think>", "", "Text first <think>is not reasoning</think>"),
]


def split(prompt: str, text: str, size: int) -> tuple[str, str]:
  parser, reasoning, content = Qwen3ReasoningParser(prompt), "", ""
  chunks = pieces(text, size)
  for i, piece in enumerate(chunks):
    r, c = parser.feed(piece, i == len(chunks) - 1)
    reasoning, content = reasoning + r, content + c
  return reasoning, content


@pytest.mark.parametrize("text,reasoning,content", REASONING_CASES)
def test_qwen3_reasoning_split(text, reasoning, content):
  assert {split(QWEN3_PROMPT, text, size) for size in SIZES} == {(reasoning, content)}


def test_a_prompt_that_opens_the_think_block_starts_the_reply_inside_it():
  assert split(QWEN3_PROMPT + "<think>\n", "Thinking.\n</think>\n\nAnswer.", 3) == ("Thinking.", "Answer.")
  # enable_thinking=False: the template closes an empty block in the prompt, and the reply is all content
  assert split(QWEN3_PROMPT + "<think>\n\n</think>\n\n", "Answer.", 3) == ("", "Answer.")


def request(**fields) -> ChatCompletionRequest:
  return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
  "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"],
  "$defs": {"city": {"enum": ["Paris", "Oslo"]}}}}}
PING = {"type": "function", "function": {"name": "ping"}}
AUTO = ChatSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_the_output_parser_splits_reasoning_then_reads_calls_in_the_content():
  plan = plan_tools(request(tools=[WEATHER]), AUTO)
  text = ('<think>\nShould I call <tool_call>? Yes.\n</think>\n\nChecking.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
  whole = ChatOutputParser(plan, "qwen3", QWEN3_PROMPT, True)
  message = whole.message(text)
  assert (message.reasoning_content, message.content) == ("Should I call <tool_call>? Yes.", "Checking.")
  assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
  assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
  for size in SIZES:   # streamed: the same parts
    streamed = ChatOutputParser(plan, "qwen3", QWEN3_PROMPT, True)
    chunks = pieces(text, size)
    deltas = [streamed.feed(p, i == len(chunks) - 1) for i, p in enumerate(chunks)]
    assert "".join(d.reasoning for d in deltas) == message.reasoning_content
    assert "".join(d.content for d in deltas) == message.content
  hidden = ChatOutputParser(plan, "qwen3", QWEN3_PROMPT, False).message(text)   # include_reasoning: false
  assert hidden.reasoning_content is None and hidden.content == "Checking." and len(hidden.tool_calls) == 1


def test_a_forced_call_after_the_reasoning():
  """With a reasoning parser the engine's grammar starts after the reasoning (vLLM's): a required call's reply is the
  reasoning, then the array of calls, whole and streamed."""
  plan = ToolPlan(schema={"type": "array"}, parser=RequiredToolCalls)
  text = '<think>\nThe user wants the time.\n</think>\n\n[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
  message = ChatOutputParser(plan, "qwen3", QWEN3_PROMPT, True).message(text)
  assert (message.content, message.reasoning_content) == (None, "The user wants the time.")
  assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("get_time", {"zone": "UTC"})]
  streamed = ChatOutputParser(plan, "qwen3", QWEN3_PROMPT, True)
  deltas = [streamed.feed(text[i:i + 5], i + 5 >= len(text)) for i in range(0, len(text), 5)]
  assert "".join(d.reasoning for d in deltas) == "The user wants the time." and not "".join(d.content for d in deltas)
  assert [d.name for delta in deltas for d in delta.tool_calls if d.name] == ["get_time"]


def test_parallel_tool_calls_false_keeps_the_first_call():
  plan = plan_tools(request(tools=[WEATHER, PING], parallel_tool_calls=False), AUTO)
  message = ChatOutputParser(plan, None, "", True).message(HERMES_TWO_CALLS)
  assert [c.function.name for c in message.tool_calls] == ["get_weather"]
  assert plan_tools(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), AUTO).schema["maxItems"] == 1


def test_without_parsers_the_text_is_the_content():
  parser = ChatOutputParser(ToolPlan(), None, "", True)
  message = parser.message("<think>x</think> <tool_call>{}</tool_call>")
  assert message.content == "<think>x</think> <tool_call>{}</tool_call>" and not message.tool_calls
  assert parser.finish_reason("stop") == "stop"


def test_the_schemas_of_forced_calls_are_vllms():
  required = plan_tools(request(tools=[WEATHER, PING], tool_choice="required"), ChatSettings())
  assert required.schema == required_schema_expected()
  assert WEATHER["function"]["parameters"]["$defs"]   # the request's tools are left as they were
  named = plan_tools(request(tools=[WEATHER, PING], tool_choice={"type": "function", "function": {"name": "ping"}}), ChatSettings())
  assert named.schema == {"type": "object", "properties": {}} and not named.finish_as_calls
  assert required_schema([], None) == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": []}}


def required_schema_expected() -> dict:
  weather = {k: v for k, v in WEATHER["function"]["parameters"].items() if k != "$defs"}
  return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
    {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": weather}, "required": ["name", "parameters"],
     "additionalProperties": False},
    {"properties": {"name": {"type": "string", "enum": ["ping"]}, "parameters": {"type": "object", "properties": {}}},
     "required": ["name", "parameters"], "additionalProperties": False}]}, "$defs": {"city": {"enum": ["Paris", "Oslo"]}}}


@pytest.mark.parametrize("fields,settings,param,words", [
  ({"tools": [WEATHER]}, ChatSettings(), "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
  ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, AUTO, "tool_choice",
   "'get_time', which is not in tools (get_weather)"),
  ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, AUTO, "tool_choice", "no tools"),
  ({"tools": [WEATHER, WEATHER]}, AUTO, "tools", "tools[1].function.name 'get_weather' is given twice"),
  ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, AUTO, "tools", "strict"),
])
def test_tool_requests_that_cannot_be_honoured_are_named(fields, settings, param, words):
  with pytest.raises(APIError) as e: plan_tools(request(**fields), settings)
  assert (e.value.status, e.value.param) == (400, param) and words in e.value.message


def test_what_asks_for_no_tools_plans_none():
  for fields in ({}, {"tools": []}, {"tools": [], "tool_choice": "required"}, {"tool_choice": "auto"}):
    assert plan_tools(request(**fields), ChatSettings()) == ToolPlan()
  none = plan_tools(request(tools=[WEATHER], tool_choice="none"), ChatSettings())
  assert none.template_tools == [WEATHER] and none.parser is None   # the template still gets them (vLLM's default)
  excluded = ChatSettings(exclude_tools_when_tool_choice_none=True)
  assert plan_tools(request(tools=[WEATHER], tool_choice="none"), excluded).template_tools is None
