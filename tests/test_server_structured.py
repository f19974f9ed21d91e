"""The server's output controls through the official `openai` client: response_format (json_object, json_schema with
strict) on the chat endpoint, whole and streamed; vLLM's structured_outputs and guided_* fields and the token controls
on completions; each bad value a 400 naming its field, the server serving on."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.server_process import ServerProcess, model_with_chat_template

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow

MODEL = "stories"
PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
       "required": ["name", "legs"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Tell me about a pet."}]


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory, data_parallel_size):
  model = model_with_chat_template(stories_dir, tmp_path_factory.mktemp("model") / "stories-chat")
  # (greedy, this tiny model would fill JSON's optional whitespace with newlines until max_tokens)
  with ServerProcess(model, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", MODEL, "--num-gpu-blocks", "64",
                     "--structured-outputs-config", '{"disable_any_whitespace": true}',
                     "--data-parallel-size", str(data_parallel_size)) as s:
    yield s


@pytest.fixture(scope="module")
def client(server): return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_response_format_round_trips(client):
  schema_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
  sampled = {"model": MODEL, "messages": CHAT, "max_tokens": 100, "temperature": 0}
  whole = client.chat.completions.create(**sampled, response_format=schema_format)
  jsonschema.validate(json.loads(whole.choices[0].message.content), PET)
  assert whole.choices[0].finish_reason == "stop"
  stream = client.chat.completions.create(**sampled, response_format=schema_format, stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
  # any object: the keys and values are free text, which a story model rarely closes; a bias on "}" (token 128) helps
  anything = client.chat.completions.create(**sampled, response_format={"type": "json_object"}, logit_bias={"128": 8})
  assert isinstance(json.loads(anything.choices[0].message.content), dict) and anything.choices[0].finish_reason == "stop"


def test_disable_additional_properties_closes_the_schemas_objects(client):
  """An open object (no additionalProperties) with disable_additional_properties: the output has the schema's keys
  only (validated against the closed schema), as vLLM's guidance backend gives."""
  open_pet = {key: value for key, value in PET.items() if key != "additionalProperties"}
  out = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=60, temperature=1.0, seed=3, n=4,
                                  extra_body={"structured_outputs": {"json": open_pet, "disable_additional_properties": True}})
  for choice in out.choices: jsonschema.validate(json.loads(choice.text), PET)


def test_structural_tags_on_both_endpoints(client):
  """vLLM's structural_tag as a chat response_format and as structured_outputs.structural_tag (and its older request
  field): with "<" (token 504) pushed by a bias, every block the model opens holds one digit and ends."""
  from tests.test_structured_output import DIGIT_TAG, digit_blocks
  tag = json.loads(DIGIT_TAG)
  chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, logit_bias={"504": 100},
                                        response_format={"type": "structural_tag", **tag})
  assert digit_blocks(chat.choices[0].message.content) >= 2, chat.choices[0].message.content
  for extra in ({"structured_outputs": {"structural_tag": DIGIT_TAG}}, {"structural_tag": DIGIT_TAG}):
    out = client.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0, logit_bias={"504": 100},
                                    extra_body=extra)
    assert digit_blocks(out.choices[0].text) >= 2, out.choices[0].text


def test_completions_take_vllm_constraints_and_token_controls(client):
  regex = r"[A-Z][a-z]{2,6} (ran|sat|ate)\."
  out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=1.0, seed=5, n=3,
                                  extra_body={"structured_outputs": {"regex": regex}})
  assert all(re.fullmatch(regex, c.text) for c in out.choices)
  choice = client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0,
                                     extra_body={"guided_choice": ["sat on a mat", "ran away"]})
  assert choice.choices[0].text in ("sat on a mat", "ran away")
  forced = client.completions.create(model=MODEL, prompt="The cat", max_tokens=5, temperature=0, logit_bias={"13": 100},
                                     extra_body={"return_token_ids": True, "min_tokens": 5})
  assert forced.choices[0].model_extra["token_ids"] == [13] * 5
  allowed = client.completions.create(model=MODEL, prompt="The cat", max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True, "allowed_token_ids": [13, 14], "bad_words": ["dog"]})
  assert set(allowed.choices[0].model_extra["token_ids"]) <= {13, 14}


@pytest.mark.parametrize("path, fields, param", [
  ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
  ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
  ("chat", {"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs"),
  ("completions", {"guided_regex": r"(a)\1"}, "guided_regex"),
  ("completions", {"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
  ("completions", {"structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": [True]}}, "structured_outputs"),
  ("completions", {"structured_outputs": {"structural_tag": '{"structures": [], "triggers": ["<"]}'}}, "structured_outputs"),
  ("chat", {"response_format": {"type": "structural_tag", "triggers": ["<"]}}, "response_format"),
  ("completions", {"logit_bias": {"100000": 5}}, "logit_bias"),
  ("completions", {"logit_bias": {"7": 200}}, "logit_bias"),
  ("completions", {"logit_bias": {"seven": 1}}, "logit_bias"),
  ("chat", {"allowed_token_ids": [600]}, "allowed_token_ids"),
  ("completions", {"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
])
def test_bad_values_are_400s_naming_the_field(server, path, fields, param):
  body = ({"model": MODEL, "messages": CHAT} if path == "chat" else {"model": MODEL, "prompt": "Once"}) | {"max_tokens": 5} | fields
  r = httpx.post(f"{server.url}/v1/{'chat/' if path == 'chat' else ''}completions", json=body, timeout=60)
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param
  ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2}, timeout=60)
  assert ok.status_code == 200
