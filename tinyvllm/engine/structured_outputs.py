"""Structured output's grammars, through llguidance (the `structured` extra; vLLM's guidance backend does the same).

A request's StructuredOutputsParams becomes llguidance grammar text (`grammar_text`): a JSON schema (or any JSON object)
through llguidance's JSON compiler, whitespace flexible unless `disable_any_whitespace` (or as `whitespace_pattern`
says); a regex; a choice as a Lark alternative of string literals; a grammar in Lark or llama.cpp's GBNF. The input
processor checks it when the request comes (`check_grammar`: an invalid schema or an unsupported regex feature is
refused naming the field); the engine core compiles it once per request against the llguidance tokenizer it builds
from tinyvllm's tokenizer on the first structured request (`GrammarCompiler`), and each of the request's samples
gets a copy of the matcher.
"""
from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tinyvllm.config import REASONING_MARKERS
from tinyvllm.core.structured_output import StructuredOutputGrammar
from tinyvllm.engine.core_setup import log
from tinyvllm.sampling_params import CONSTRAINT_KINDS, SamplingParamsError, StructuredOutputsParams, structural_tags
from tinyvllm.tokenizer import Tokenizer

PARAM = "structured_outputs"
CACHED_GRAMMARS = 256   # compiled matchers kept for repeated grammars (the same schema in many requests)


def require_llguidance() -> Any:
  try:
    import llguidance
  except ImportError:
    raise SamplingParamsError(PARAM, "structured output needs llguidance, which is not installed: "
                                     "pip install 'tinyvllm[structured]'") from None
  return llguidance


def kind_of(params: StructuredOutputsParams) -> str:
  """Which constraint the params hold (one of CONSTRAINT_KINDS)."""
  return next(name for name in CONSTRAINT_KINDS if getattr(params, name) is not None)


def grammar_text(params: StructuredOutputsParams, disable_any_whitespace: bool = False) -> str:
  """The llguidance grammar of the params (not yet checked: see check_grammar); disable_any_whitespace: the engine's
  (structured_outputs_config), for every JSON constraint without a whitespace_pattern."""
  llg, kind = require_llguidance(), kind_of(params)
  if kind in ("json", "json_object"):
    schema = {"type": "object"} if kind == "json_object" else params.json
    if kind == "json" and params.disable_additional_properties: schema = closed_objects(schema)
    options: dict[str, Any] = {"whitespace_flexible": not (params.disable_any_whitespace or disable_any_whitespace)}
    if params.whitespace_pattern is not None: options["whitespace_pattern"] = params.whitespace_pattern
    try: return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except ValueError as e: raise SamplingParamsError(PARAM, f"structured_outputs.json is not a JSON schema: {e}") from None
  if kind == "regex": return llg.LLMatcher.grammar_from_regex(params.regex)
  if kind == "structural_tag":
    tags = [llg.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end)
            for trigger, begin, schema, end in structural_tags(params.structural_tag)]
    return llg.StructTag.to_grammar(tags)
  if kind == "choice": return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice or []))
  try: return llg.grammar_from("grammar", params.grammar)   # Lark, or GBNF converted to Lark
  except ValueError as e: raise SamplingParamsError(PARAM, f"structured_outputs.grammar: {e}") from None


def closed_objects(schema: str | dict) -> dict:
  """A copy of the JSON schema in which every subschema with properties (or patternProperties) that does not say
  whether other properties may follow says additionalProperties: false."""
  if isinstance(schema, str):
    try: schema = json.loads(schema)
    except json.JSONDecodeError as e: raise SamplingParamsError(PARAM, f"structured_outputs.json is not JSON: {e}") from None

  def close(node: Any) -> Any:
    if isinstance(node, list): return [close(x) for x in node]
    if not isinstance(node, dict): return node
    out = {key: close(value) for key, value in node.items()}
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out: out["additionalProperties"] = False
    return out
  return close(schema)


def check_grammar(params: StructuredOutputsParams) -> None:
  """Refuse (naming the field) a grammar llguidance cannot compile."""
  if error := _grammar_error(grammar_text(params)):
    raise SamplingParamsError(PARAM, f"structured_outputs.{kind_of(params)} is not valid: {error.strip()}")


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _grammar_error(text: str) -> str:
  """llguidance's complaint about the grammar ("" when it compiles); remembered, as requests often repeat a schema."""
  return require_llguidance().LLMatcher.validate_grammar(text)


class _TokenizerAdapter:
  """What llguidance.TokenizerWrapper reads: every id's bytes (ids past the tokenizer's, in a model with more rows,
  are empty: never allowed), the special ids (never matched by a grammar's text) and an encoder of continuation text."""

  def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
    self.eos_token_id, self.bos_token_id = eos_token_ids[0], tokenizer.bos_token_id
    self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
    self.special_token_ids = sorted(tokenizer.special_token_ids)
    self._tokenizer = tokenizer

  def __call__(self, text: bytes | str) -> list[int]:
    if isinstance(text, bytes): text = text.decode("utf-8", errors="replace")
    return self._tokenizer.encode_continuation(text)


class GrammarCompiler:
  """The engine core's: the llguidance tokenizer (built on the first structured request: about half a second for a
  150k vocabulary) and the compiled grammars, the most recent kept for requests that repeat them."""

  def __init__(self, load_tokenizer: Callable[[], Tokenizer | None], vocab_size: int, eos_token_ids: list[int],
               disable_any_whitespace: bool = False, reasoning_parser: str | None = None):
    self._load_tokenizer, self._vocab_size, self._eos = load_tokenizer, vocab_size, sorted(eos_token_ids)
    self._disable_any_whitespace, self._reasoning_parser = disable_any_whitespace, reasoning_parser
    self._markers: tuple[int, int] | None = None
    self._ll_tokenizer: Any = None
    self._cache: OrderedDict[str, StructuredOutputGrammar] = OrderedDict()

  def compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
    """A fresh matcher for the params (ValueError if they cannot be compiled for this tokenizer)."""
    text = grammar_text(params, self._disable_any_whitespace)
    if (cached := self._cache.get(text)) is not None:
      self._cache.move_to_end(text)
      return cached.copy()
    llg = require_llguidance()
    matcher = llg.LLMatcher(self._llguidance_tokenizer(), text, log_level=0)
    if matcher.is_error(): raise SamplingParamsError(PARAM, f"structured_outputs.{kind_of(params)}: {matcher.get_error()}")
    grammar = StructuredOutputGrammar(matcher)
    self._cache[text] = grammar
    if len(self._cache) > CACHED_GRAMMARS: self._cache.popitem(last=False)
    return grammar.copy()

  def reasoning_markers(self) -> tuple[int, int] | None:
    """The reasoning parser's start and end token ids (None without a parser): a constraint starts after the end."""
    if self._reasoning_parser is None or self._markers is not None: return self._markers
    tokenizer = self._load_tokenizer()
    if tokenizer is None: raise SamplingParamsError(PARAM, "structured output needs a tokenizer and this model has none")
    ids = []
    for marker in REASONING_MARKERS[self._reasoning_parser]:
      encoded = tokenizer.added_tokens.get(marker)
      if encoded is None:
        raise SamplingParamsError(PARAM, f"reasoning parser {self._reasoning_parser}: {marker!r} is not one token of this "
                                         "model's tokenizer, so the reasoning's end cannot be told")
      ids.append(encoded)
    self._markers = (ids[0], ids[1])
    return self._markers

  def _llguidance_tokenizer(self) -> Any:
    if self._ll_tokenizer is None:
      tokenizer = self._load_tokenizer()
      if tokenizer is None: raise SamplingParamsError(PARAM, "structured output needs a tokenizer and this model has none")
      self._eos = sorted(set(self._eos) | tokenizer.eos_token_ids)
      if not self._eos: raise SamplingParamsError(PARAM, "structured output needs an EOS token and this model has none")
      llg = require_llguidance()
      adapter = _TokenizerAdapter(tokenizer, self._vocab_size, self._eos)
      self._ll_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(adapter), n_vocab=self._vocab_size, eos_token=self._eos)
      log(f"structured output: llguidance {llg.__version__}'s tokenizer built ({self._vocab_size} token ids)")
    return self._ll_tokenizer
