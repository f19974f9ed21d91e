"""Structured output (vLLM's StructuredOutputsParams through llguidance): on a random-weight model, where only the mask
makes an output valid, 200 generations under each of 10 JSON schemas validate (the `jsonschema` package), and regexes,
choices and a Lark arithmetic grammar all match (Python's `re`, `ast`); on stories260K, structured rows leave free
rows' greedy output alone, work with n > 1, stop strings and streaming, and greedy structured output is the same with
n-gram speculative decoding and through preemption (by recomputation and by swapping)."""
from __future__ import annotations

import ast
import json
import re
from dataclasses import replace

import numpy as np
import pytest

from tests.conftest import assert_all_free
from tinyvllm import LLM, SamplingParams
from tinyvllm.core.structured_output import BitmaskFiller
from tinyvllm.engine.structured_outputs import GrammarCompiler, check_grammar
from tinyvllm.sampling_params import SamplingParamsError, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

EOS = 2
PER_CONSTRAINT = 200
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}
SCHEMAS = [
  # a flat object, every field required
  {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
   "required": ["name", "age"], "additionalProperties": False},
  # nested objects
  {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                                              "admin": {"type": "boolean"}},
                                             "required": ["id", "admin"], "additionalProperties": False},
                                    "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
  # an array of bounded integers
  {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
  # enums
  {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", 1, None]}},
   "required": ["color", "size"], "additionalProperties": False},
  # numbers with bounds (and steps: a random model would write digits forever; binary fractions, which jsonschema's float
  # check of multipleOf gets right)
  {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
                                    "t": {"type": "number", "exclusiveMinimum": -40, "exclusiveMaximum": 50, "multipleOf": 0.5}},
   "required": ["p", "t"], "additionalProperties": False},
  # required and optional fields
  {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "note": {"type": "string", "maxLength": 4},
                                    "flag": {"type": "boolean"}}, "required": ["id"], "additionalProperties": False},
  # $ref to definitions
  {"$defs": {"point": POINT}, "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
   "required": ["start", "end"], "additionalProperties": False},
  # an array of objects
  {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3},
                                                               "v": {"type": "integer", "minimum": 0, "maximum": 9}},
                              "required": ["k", "v"], "additionalProperties": False}, "maxItems": 3},
  # anyOf
  {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}, {"type": "null"}, POINT]},
  # a string pattern and a constant
  {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "kind": {"const": "item"}},
   "required": ["code", "kind"], "additionalProperties": False},
]
REGEXES = [r"[a-z]{3,8}", r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)( [A-Z][a-z]{1,4}){0,2}"]
CHOICES = ["red", "green", "blue", "cyan magenta"]
ARITHMETIC = """
start: expr
expr: atom (OP atom){0,3}
atom: NUM | "(" NUM (OP NUM){0,2} ")"
OP: "+" | "-" | "*"
NUM: /[1-9][0-9]?/ | "0"
"""


def _params(seed: int, max_tokens: int = 96, **structured) -> SamplingParams:
  return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**structured))


def _arithmetic(text: str) -> bool:
  """Python's own parser: an expression of integers, + - * and parentheses only."""
  allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
  return all(isinstance(node, allowed) for node in ast.walk(ast.parse(text, mode="eval"))) and not re.search(r"\b0\d", text)


# ---- the boundary
@pytest.mark.parametrize("structured, words", [
  ({"json": {"type": "objekt"}}, "json"), ({"json": {"$ref": "#/$defs/missing"}}, "json"), ({"json": "{not json"}, "json"),
  ({"regex": "(?=a)b"}, "look-around"), ({"regex": r"(a)\1"}, "backreference"), ({"grammar": "start: missing_rule"}, "grammar"),
])
def test_invalid_constraints_are_refused_naming_the_field(structured, words):
  with pytest.raises(SamplingParamsError) as e: check_grammar(StructuredOutputsParams(**structured))
  assert e.value.param == "structured_outputs" and words in str(e.value)


def test_exactly_one_constraint():
  for kwargs in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json_object": False}):
    with pytest.raises(SamplingParamsError) as e: StructuredOutputsParams(**kwargs)
    assert e.value.param == "structured_outputs"


def test_qwen3_tokenizer_masks(qwen):
  """An llguidance tokenizer over tinyvllm's Qwen3 tokenizer in a model of 151,936 rows: ids past the tokenizer's are
  never allowed, a special token never spells a grammar's text, EOS is allowed once the grammar accepts."""
  grammar = GrammarCompiler(lambda: qwen, 151936, [151645]).compile(StructuredOutputsParams(regex=r"<\|im_end\|>( ok)?"))
  filler, bitmask = BitmaskFiller(), np.full((1, 151936 // 32), -1, np.int32)

  def allowed() -> set[int]:
    filler.fill([(grammar, 0, [])], bitmask)
    return set(np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")).tolist())
  spelled = b""
  while spelled != b"<|im_end|>":
    tokens = allowed()
    assert tokens and max(tokens) < qwen.vocab_size and not tokens & qwen.special_token_ids
    token = min(tokens)
    assert not grammar.advance(token)
    spelled += qwen.token_bytes(token)
  assert 151645 in allowed() and grammar.advance(151645)   # accepting: EOS ends it


def test_disable_additional_properties_closes_every_open_object(qwen):
  """Every object with properties that does not say otherwise gets additionalProperties: false (nested, in arrays and
  $defs; an explicit setting is kept, a JSON string schema too); the grammar then refuses a key the schema lacks, which
  it accepts without the flag."""
  from tinyvllm.engine.structured_outputs import closed_objects
  schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                            "list": {"type": "array", "items": {"patternProperties": {"^x": {}}}},
                                            "free": {"type": "object", "properties": {}, "additionalProperties": True}},
            "$defs": {"p": {"properties": {"q": {}}}}, "required": ["a"]}
  closed = closed_objects(json.dumps(schema))
  assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
  assert closed["properties"]["list"]["items"]["additionalProperties"] is False
  assert closed["properties"]["free"]["additionalProperties"] is True and closed["$defs"]["p"]["additionalProperties"] is False
  assert "additionalProperties" not in schema and "additionalProperties" not in closed["properties"]["list"]   # a copy; arrays stay open
  compiler = GrammarCompiler(lambda: qwen, 151936, [151645])
  pet = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
  extra = qwen.encode_continuation('{"name":"Rex","legs":4}')
  for flag, accepted in ((False, len(extra)), (True, None)):
    params = StructuredOutputsParams(json=pet, disable_additional_properties=flag, disable_any_whitespace=True)
    count = compiler.compile(params).matcher.validate_tokens(extra)
    assert count == accepted if accepted is not None else count < len(extra), (flag, count)
  with pytest.raises(SamplingParamsError, match="disable_additional_properties must be a bool"):
    StructuredOutputsParams(json=pet, disable_additional_properties="yes")


def test_a_grammar_after_reasoning_masks_only_the_rows_after_its_end(qwen):
  """While the model reasons, its rows are free; a verification's rows after a proposal that ends the reasoning get the
  grammar's masks from its start (the same as a fresh grammar's, then after the next proposal)."""
  from types import SimpleNamespace

  from tinyvllm.worker.token_controls import TokenControls
  compiler, end = GrammarCompiler(lambda: qwen, 151936, [151645]), 151668
  params = StructuredOutputsParams(choice=["yes", "no"])
  yes = qwen.encode_continuation("yes")[0]
  words, filler = 151936 // 32, BitmaskFiller()
  controls = TokenControls(bitmask=np.full((5, words), -1, np.int32), filler=filler, grammar_rows=[
    (SimpleNamespace(grammar=compiler.compile(params).after_reasoning(end), is_finished=False), 0, [11, end, yes, 12])])
  controls.fill_bitmask()
  fresh, expected = compiler.compile(params), np.full((2, words), -1, np.int32)
  filler.fill([(fresh, 0, [])], expected[:1])
  assert fresh.matcher.consume_token(yes)
  filler.fill([(fresh, 1, [])], expected)
  assert (controls.bitmask[:2] == -1).all()   # reasoning: free
  np.testing.assert_array_equal(controls.bitmask[2:4], expected)
  assert not (controls.bitmask[2] == -1).all()
  waiting = compiler.compile(params).after_reasoning(end)
  assert not waiting.active and not waiting.advance(11) and not waiting.advance(end) and waiting.active


DIGIT_TAG = json.dumps({"structures": [{"begin": "<f>", "schema": {"type": "integer", "minimum": 0, "maximum": 9}, "end": "</f>"}],
                        "triggers": ["<"]})


def digit_blocks(text: str) -> int:
  """How many <f>D</f> blocks text holds, every block it opens having a digit and its end (the last may be cut)."""
  blocks = re.findall(r"<f>\d</f>", text)
  cut = text[text.rfind("<f>"):] if text.count("<f>") > len(blocks) else ""
  assert text.count("<f>") <= len(blocks) + 1 and (not cut or "<f>0</f>".startswith(re.sub(r"\d", "0", cut))), text
  return len(blocks)


@pytest.mark.parametrize("tag, words", [
  ("{", "is not JSON"),
  (json.dumps({"structures": [], "triggers": ["<"]}), "structures must be a non-empty list"),
  (json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": []}), "triggers must be a non-empty list"),
  (json.dumps({"structures": [{"begin": "[f]", "schema": {}, "end": ""}], "triggers": ["<"]}), "starts with none of the triggers"),
  (json.dumps({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<"]}), "structures[0] must be an object of begin"),
  (json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": ["<"], "tags": 1}), "an object of structures"),
])
def test_bad_structural_tags_are_refused_naming_the_part(tag, words):
  with pytest.raises(SamplingParamsError, match=re.escape(words)) as e: StructuredOutputsParams(structural_tag=tag)
  assert e.value.param == "structured_outputs"


@pytest.mark.slow
def test_a_structural_tag_constrains_what_follows_each_trigger(tiny_qwen3):
  """vLLM's structural_tag: free text in which the trigger starts a structure (its begin, JSON under its schema, its
  end), then free text again. "<" (token 27) pushed by a bias: every block the model opens holds one digit and ends."""
  llm = LLM(str(tiny_qwen3), load_format="dummy", max_num_seqs=4, num_gpu_blocks=64, max_model_len=256)
  pushed = SamplingParams(temperature=0, max_tokens=24, logit_bias={27: 100}, ignore_eos=True)
  tagged = replace(pushed, structured_outputs=StructuredOutputsParams(structural_tag=DIGIT_TAG))
  free, out = (llm.generate(["Go:"], p, use_tqdm=False)[0].outputs[0].text for p in (pushed, tagged))
  assert free.startswith("<<<"), free   # without the tag: the bias alone
  assert out.startswith("<f>") and digit_blocks(out) >= 2, out


@pytest.fixture(scope="module")
def tiny_qwen3(shared_data, tmp_path_factory):
  """A random-weight Qwen3 with the real Qwen3 tokenizer (its <think> and </think> are one token each)."""
  import shutil

  from tests.test_server_tools import CONFIG
  from tests.test_tokenizer import QWEN3
  folder = tmp_path_factory.mktemp("model") / "tiny-qwen3"
  shutil.copytree(shared_data / QWEN3, folder, ignore=shutil.ignore_patterns("derived"))
  (folder / "config.json").write_text(json.dumps(CONFIG))
  return folder


@pytest.mark.slow
def test_with_a_reasoning_parser_the_constraint_starts_after_the_reasoning(tiny_qwen3):
  """vLLM's --reasoning-parser semantics: the model reasons freely and the grammar holds from after </think>; a prompt
  that closed its reasoning is constrained from the first token; without a parser, from the first token."""
  settings = dict(load_format="dummy", max_num_seqs=4, num_gpu_blocks=64, max_model_len=256)
  thinking, plain = LLM(str(tiny_qwen3), reasoning_parser="qwen3", **settings), LLM(str(tiny_qwen3), **settings)
  choice, end = StructuredOutputsParams(choice=["yes", "no"]), 151668
  ends_reasoning = SamplingParams(temperature=0, max_tokens=8, logit_bias={end: 100}, structured_outputs=choice)
  out = thinking.generate(["Answer:"], ends_reasoning, use_tqdm=False)[0].outputs[0]
  assert out.token_ids[0] == end and out.text in ("</think>yes", "</think>no") and out.finish_reason == "stop", out
  for llm, prompt in ((plain, "Answer:"), (thinking, "<think>\n\n</think>\n\nAnswer:")):
    out = llm.generate([prompt], ends_reasoning, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop", out
  free_params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice)
  free = thinking.generate(["Answer:"], free_params, use_tqdm=False)[0].outputs[0]
  assert end not in free.token_ids and free.text not in ("yes", "no") and free.finish_reason == "length"   # still reasoning
  assert_all_free(thinking)


# ---- a random-weight model: only the mask makes its outputs valid
@pytest.fixture(scope="module")
def random_llm(stories_dir):
  return LLM(str(stories_dir), load_format="dummy", seed=0, max_num_seqs=256, num_gpu_blocks=2048, max_model_len=256)


@pytest.mark.slow
def test_random_model_outputs_all_valid(random_llm):
  """One generate call: 200 samples under each of the 10 schemas, 3 regexes, a choice and the arithmetic grammar."""
  constraints = ([{"json": s, "disable_any_whitespace": i != 0} for i, s in enumerate(SCHEMAS)] + [{"regex": r} for r in REGEXES]
                 + [{"choice": CHOICES}, {"grammar": ARITHMETIC}])
  params = [_params(1000 * c + i, **kw) for c, kw in enumerate(constraints) for i in range(PER_CONSTRAINT)]
  outs = random_llm.generate([[1]] * len(params), params, use_tqdm=False)
  texts = [o.outputs[0].text for o in outs]
  assert all(o.outputs[0].finish_reason == "stop" for o in outs)
  for c, schema in enumerate(SCHEMAS):
    for text in texts[c * PER_CONSTRAINT:(c + 1) * PER_CONSTRAINT]: jsonschema.validate(json.loads(text), schema)
  base = len(SCHEMAS) * PER_CONSTRAINT
  for r, regex in enumerate(REGEXES):
    assert all(re.fullmatch(regex, t) for t in texts[base + r * PER_CONSTRAINT:base + (r + 1) * PER_CONSTRAINT])
  base += len(REGEXES) * PER_CONSTRAINT
  assert all(t in CHOICES for t in texts[base:base + PER_CONSTRAINT]) and len(set(texts[base:base + PER_CONSTRAINT])) == len(CHOICES)
  assert all(_arithmetic(t) for t in texts[base + PER_CONSTRAINT:])
  assert len(set(texts)) > len(texts) // 2   # (the samples differ: the mask, not a fixed output, made them valid)
  assert_all_free(random_llm)


def test_without_llguidance_the_error_says_how_to_install(monkeypatch):
  monkeypatch.setitem(__import__("sys").modules, "llguidance", None)   # import llguidance then raises ImportError
  with pytest.raises(SamplingParamsError) as e: check_grammar(StructuredOutputsParams(regex="[a-z]+"))
  assert e.value.param == "structured_outputs" and "pip install 'tinyvllm[structured]'" in str(e.value)


# ---- stories260K: a real model
PROMPT = "Once upon a time"
STORY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 1, "maximum": 12},
                                          "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
         "required": ["name", "age", "friends"], "additionalProperties": False}
WORDS = r"( [a-z]{1,8}){3,6}\."
LONG_WORDS = r"( [a-z]{1,8}){24,30}\."


def _greedy(max_tokens: int = 80, **structured) -> SamplingParams:
  return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**structured))


@pytest.mark.slow
def test_structured_rows_leave_free_rows_alone(llm):
  free, plain = ["Tom and Sue", "The dog was happy."], SamplingParams(temperature=0, max_tokens=16)
  alone = [o.outputs[0].token_ids for o in llm.generate(free, plain, use_tqdm=False)]
  sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=WORDS))
  mixed = llm.generate([free[0], PROMPT, free[1], PROMPT],
                       [plain, _greedy(json=STORY, disable_any_whitespace=True), plain, sampled], use_tqdm=False)
  assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
  story = mixed[1].outputs[0]
  jsonschema.validate(json.loads(story.text), STORY)
  assert story.finish_reason == "stop" and EOS not in story.token_ids   # the grammar ended it, its last token's text kept
  assert len(mixed[3].outputs) == 3 and all(re.fullmatch(WORDS, o.text) for o in mixed[3].outputs)
  assert len({o.text for o in mixed[3].outputs}) > 1
  assert_all_free(llm)


@pytest.mark.slow
def test_stop_strings_and_streaming(llm):
  params = _greedy(json=STORY, disable_any_whitespace=True)
  full = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
  assert "".join(llm.stream(PROMPT, params)) == full
  stop = full[len(full) // 2:len(full) // 2 + 3]
  stopped = SamplingParams(temperature=0, max_tokens=80, stop=[stop], structured_outputs=params.structured_outputs)
  cut = llm.generate([PROMPT], stopped, use_tqdm=False)[0].outputs[0]
  assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
  assert_all_free(llm)


@pytest.mark.slow
def test_speculation_and_preemption_keep_greedy_structured_output(llm, stories_dir):
  """n-gram speculative decoding and a KV cache too small for the batch (preemption by recomputation): the same greedy
  structured outputs as a plain engine's, all valid."""
  prompts = [PROMPT, "Tom and Sue", "The dog was happy.", "Lily saw a bird."]
  params = [_greedy(json=STORY, disable_any_whitespace=True), _greedy(regex=LONG_WORDS)] * 2
  plain = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
  tight = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=7, speculative_config={   # 7 blocks: 2 or 3 sequences at a time
    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
  outs = tight.generate(prompts, params, use_tqdm=False)
  assert [o.outputs[0].text for o in outs] == plain
  assert tight.engine.scheduler.num_preemptions > 0 and sum(o.metrics.num_accepted_tokens for o in outs) > 0
  for text in plain[::2]: jsonschema.validate(json.loads(text), STORY)
  assert all(re.fullmatch(LONG_WORDS, t) for t in plain[1::2])
  assert_all_free(tight)


@pytest.mark.slow
def test_preemption_by_swapping_keeps_greedy_structured_output(llm, stories_dir):
  """A KV cache too small for the batch with preemption by swapping: a swapped-out sequence's matcher stands for its
  output tokens, which come back with its blocks; the same greedy structured outputs as a plain engine's, all valid."""
  prompts = [PROMPT, "Tom and Sue", "The dog was happy.", "Lily saw a bird."]
  params = [_greedy(json=STORY, disable_any_whitespace=True), _greedy(regex=LONG_WORDS)] * 2
  plain = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
  tight = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=7, preemption_mode="swap", swap_space=0.01)
  outs = tight.generate(prompts, params, use_tqdm=False)
  assert [o.outputs[0].text for o in outs] == plain
  sched = tight.engine.scheduler
  assert sched.num_preemptions > 0 and sched.num_swapped_out_blocks > 0 and sched.num_swapped_in_blocks > 0
  assert sched.num_swap_fallbacks == 0
  for text in plain[::2]: jsonschema.validate(json.loads(text), STORY)
  assert all(re.fullmatch(LONG_WORDS, t) for t in plain[1::2])
  assert_all_free(tight)


@pytest.mark.slow
def test_asynchronous_scheduling_changes_nothing(llm, stories_dir):
  """Under asynchronous scheduling the steps of rows whose preparation reads their output on the host (a bad word of
  several tokens, penalties) are read before the next is scheduled; grammar rows' steps are scheduled and prepared
  while the previous step runs, their forward passes launched behind it and their sampling once it landed (their
  masks need its tokens): the outputs are the synchronous engine's, beside rows that chain ahead."""
  prompts = [PROMPT, "Tom and Sue", "The dog was happy.", "Lily saw a bird.", "Max had a red ball."]
  params = [_greedy(40, json=STORY, disable_any_whitespace=True),
            SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=WORDS)),
            SamplingParams(temperature=0, max_tokens=30, bad_words=["named Lily", "the park"]),
            SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3), SamplingParams(temperature=0, max_tokens=30)]
  expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
  ahead = LLM(str(stories_dir), max_num_seqs=8, num_gpu_blocks=64, async_scheduling=True)
  assert ahead.engine.async_scheduling
  assert [o.outputs[0].token_ids for o in ahead.generate(prompts, params, use_tqdm=False)] == expected
  assert_all_free(ahead)
  # grammar rows alone: every step after the first is prepared while the one before is still in flight
  core, in_flight_at_prepare = ahead.engine.core, []
  prepare = core.runner.prepare
  def watched(sched):   # (the step before in flight, or its sampling yet to launch: it has not landed)
    in_flight_at_prepare.append(core._in_flight is not None or core._sampling_ahead is not None)
    return prepare(sched)
  core.runner.prepare = watched
  split, launch_forward = [], core.runner.launch_forward
  def forward_ahead(step):
    launch_forward(step)
    split.append(step.logits is not None)
  core.runner.launch_forward = forward_ahead
  structured = [params[0], params[1]] * 2
  outs = ahead.generate(prompts[:4], structured, use_tqdm=False)
  assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in llm.generate(prompts[:4], structured, use_tqdm=False)]
  assert len(in_flight_at_prepare) > 20 and all(in_flight_at_prepare[2:-1]), in_flight_at_prepare
  # and their forward passes went ahead of the landing (the sampling alone waited for it)
  assert len(split) >= len(in_flight_at_prepare) - 3 and all(split), split
  assert_all_free(ahead)


def test_the_fill_writes_every_row_of_a_reused_bitmask(qwen):
  """A step's bitmask array is reused as it was left (token_controls.py sets no row beforehand): a grammar row's
  masks come from llguidance whole (every word of the row), every other row (padding, an ended sequence) all ones."""
  from types import SimpleNamespace

  from tinyvllm.worker.token_controls import TokenControls
  compiler, words = GrammarCompiler(lambda: qwen, 151936, [151645]), 151936 // 32
  params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
  rows = [(SimpleNamespace(grammar=compiler.compile(params), is_finished=finished), row, [])
          for row, finished in ((0, False), (1, True), (2, False))]
  expected = np.full((4, words), -1, np.int32)
  BitmaskFiller().fill([(seq.grammar, row, []) for seq, row, _ in rows if not seq.is_finished], expected)
  for garbage in (0, 0x5A5A5A5A):
    controls = TokenControls(bitmask=np.full((4, words), garbage, np.int32), filler=BitmaskFiller(), grammar_rows=rows)
    controls.fill_bitmask()
    np.testing.assert_array_equal(controls.bitmask, expected)
  assert not (expected[0] == -1).all() and (expected[1] == -1).all() and (expected[3] == -1).all()
