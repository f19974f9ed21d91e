"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults)."""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any


class RequestOutputKind(enum.Enum):
  """Which steps produce a RequestOutput (vLLM's names): every step with the whole output so far (CUMULATIVE, with
  the step's delta beside it), or only the finished request (FINAL_ONLY: what LLM.generate needs, and no per-step
  copies of long outputs)."""
  CUMULATIVE = 0
  FINAL_ONLY = 2


class SamplingParamsError(ValueError):
  """A sampling parameter is out of range; `param` names it (the server reports it as OpenAI's `param`)."""

  def __init__(self, param: str, message: str):
    super().__init__(message)
    self.param = param


def _check(ok: bool, param: str, message: str) -> None:
  if not ok: raise SamplingParamsError(param, message)


def _is_int(x: object) -> bool: return isinstance(x, int) and not isinstance(x, bool)
def _is_number(x: object) -> bool: return isinstance(x, (int, float)) and not isinstance(x, bool)


# The sampler computes in float32: a value it cannot hold (or would flush to zero) is refused.
FLOAT32_TINY = 1.1754943508222875e-38   # the smallest normal float32
FLOAT32_MAX = 3.4028234663852886e38
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1   # what a seed may be (it crosses to the engine core as msgpack)


def _check_in(value: object, param: str, low: float, high: float, low_open: bool = False) -> None:
  """value a finite number in [low, high] ((low, high] when low_open), and 0 or a normal float32."""
  interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
  in_range = _is_number(value) and math.isfinite(value) and (low < value if low_open else low <= value) and value <= high  # type: ignore[operator]
  _check(in_range, param, f"{param} must be a number in {interval}, got {value!r}")
  _check(value == 0 or abs(value) >= FLOAT32_TINY, param,  # type: ignore[arg-type]
         f"{param}={value!r} is below the smallest float32 (1.2e-38) the sampler computes with: use "
         f"{'' if low_open else '0 or '}at least 1.2e-38")


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def structural_tags(text: object) -> list[tuple[str, str, dict | bool, str]]:
  """(trigger, begin, schema, end) of each structure of a structural_tag (a JSON string: {"structures": [{"begin",
  "schema", "end"}, ...], "triggers": [...]}); each begin starts with one of the triggers."""
  param, name = "structured_outputs", "structured_outputs.structural_tag"
  _check(isinstance(text, str), param, f"{name} must be a JSON string")
  try: tag = json.loads(text)  # type: ignore[arg-type]
  except json.JSONDecodeError as e: raise SamplingParamsError(param, f"{name} is not JSON: {e}") from None
  _check(isinstance(tag, dict) and set(tag) <= {"type", "structures", "triggers"}, param,
         f"{name} must be an object of structures and triggers")
  triggers, structures = tag.get("triggers"), tag.get("structures")
  _check(isinstance(triggers, list) and len(triggers) > 0 and all(isinstance(t, str) and t for t in triggers), param,
         f"{name}.triggers must be a non-empty list of non-empty strings")
  _check(isinstance(structures, list) and len(structures) > 0, param, f"{name}.structures must be a non-empty list")
  out = []
  for i, s in enumerate(structures):  # type: ignore[arg-type]
    _check(isinstance(s, dict) and set(s) == {"begin", "schema", "end"} and isinstance(s["begin"], str)
           and isinstance(s["end"], str) and isinstance(s["schema"], (dict, bool)), param,
           f"{name}.structures[{i}] must be an object of begin (a string), schema (a JSON schema) and end (a string)")
    trigger = next((t for t in triggers if s["begin"].startswith(t)), None)  # type: ignore[union-attr]
    _check(trigger is not None, param, f"{name}.structures[{i}].begin {s['begin']!r} starts with none of the triggers")
    out.append((trigger, s["begin"], s["schema"], s["end"]))
  return out


@dataclass
class StructuredOutputsParams:
  """What a request's output must match (vLLM's shape): exactly one of `json` (a JSON schema, as a dict or a JSON
  string), `regex`, `choice` (the output is one of these strings), `grammar` (Lark, or llama.cpp's GBNF) and
  `json_object` (True: any JSON object), `structural_tag` (a JSON string: free text in which each of `triggers` starts
  one of `structures`, its `begin` text, then JSON under its `schema`, then its `end` text, vLLM's; see
  `structural_tags`). `disable_any_whitespace` allows no whitespace between JSON's tokens;
  `whitespace_pattern` is the regex that whitespace must match instead; `disable_additional_properties` closes every
  object of a `json` schema that has properties but does not say whether others may follow (additionalProperties
  false, as vLLM's guidance backend does). The grammar engine (llguidance, the
  `structured` extra) compiles it when the request arrives: an invalid schema or grammar is refused then."""
  json: str | dict | None = None
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None
  json_object: bool | None = None
  structural_tag: str | None = None
  disable_any_whitespace: bool = False
  whitespace_pattern: str | None = None
  disable_additional_properties: bool = False

  def __post_init__(self) -> None:
    param = "structured_outputs"
    kinds = [name for name in CONSTRAINT_KINDS if getattr(self, name) is not None]
    _check(len(kinds) == 1, param, f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KINDS)}; got "
           f"{', '.join(kinds) or 'none'}")
    if self.structural_tag is not None: structural_tags(self.structural_tag)
    _check(self.json is None or isinstance(self.json, (str, dict)), param,
           "structured_outputs.json must be a JSON schema (a dict or a JSON string)")
    for name in ("regex", "grammar"):
      value = getattr(self, name)
      _check(value is None or (isinstance(value, str) and value != ""), param, f"structured_outputs.{name} must be a non-empty string")
    _check(self.choice is None or (isinstance(self.choice, list) and len(self.choice) > 0 and all(isinstance(c, str) for c in self.choice)),
           param, "structured_outputs.choice must be a non-empty list of strings")
    _check(self.json_object in (None, True), param, "structured_outputs.json_object must be true when given")
    for flag in ("disable_any_whitespace", "disable_additional_properties"):
      _check(isinstance(getattr(self, flag), bool), param, f"structured_outputs.{flag} must be a bool")
    _check(self.whitespace_pattern is None or isinstance(self.whitespace_pattern, str), param,
           "structured_outputs.whitespace_pattern must be a string")
    _check(not (self.disable_any_whitespace and self.whitespace_pattern is not None), param,
           "structured_outputs: disable_any_whitespace and whitespace_pattern contradict each other")


@dataclass
class SamplingParams:
  """Per-request sampling settings, validated at construction.

  temperature 0 means greedy. top_k 0 or -1 turns top-k off. seed makes sampling reproducible for this request
  whatever else is batched with it. Stop conditions: EOS (unless ignore_eos), stop_token_ids, stop strings (cut from
  the text unless include_stop_str_in_output), max_tokens.
  """
  n: int = 1
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  seed: int | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  max_tokens: int | None = 16
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
  structured_outputs: StructuredOutputsParams | None = None
  # token controls (vLLM's), applied to the logits before the penalties
  logit_bias: dict[int, float] | None = None    # token id -> added to its logit, in [-100, 100] (OpenAI's)
  allowed_token_ids: list[int] | None = None    # only these may be sampled
  bad_words: list[str] | None = None            # never generated (each word's tokens with and without a leading space)
  min_tokens: int = 0                           # EOS and stop_token_ids are banned (and stop strings wait) until then
  extra_args: dict[str, Any] | None = None      # for custom logits processors (vLLM's), which read their own keys
  stop_strings: list[str] = field(init=False, repr=False)
  # bad_words as token ids, set by the engine's input processor from its tokenizer (vLLM's _bad_words_token_ids)
  _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

  def __post_init__(self) -> None:
    self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    self.stop_token_ids = list(self.stop_token_ids or [])
    self._validate()
    if self.top_k == -1: self.top_k = 0

  def _validate(self) -> None:
    _check(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
    _check_in(self.temperature, "temperature", 0, FLOAT32_MAX)
    _check_in(self.top_p, "top_p", 0, 1, low_open=True)
    _check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
           f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
    _check_in(self.min_p, "min_p", 0, 1)
    _check(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= UINT64_MAX), "seed",
           f"seed must be a 64-bit integer, got {self.seed!r}")
    for name in ("presence_penalty", "frequency_penalty"): _check_in(getattr(self, name), name, -2, 2)
    # dividing a logit by a penalty under 0.01 (or multiplying by one over 100) leaves float32's range
    _check_in(self.repetition_penalty, "repetition_penalty", 0.01, 100)
    _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
           f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
    _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", "stop must be a non-empty string or a list of them")
    _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
           f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
    for name in ("logprobs", "prompt_logprobs"):
      value = getattr(self, name)
      _check(value is None or (_is_int(value) and 0 <= value <= 20), name, f"{name} must be an integer in [0, 20], got {value!r}")
    _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
           "structured_outputs must be a StructuredOutputsParams")
    self._validate_token_controls()

  def _validate_token_controls(self) -> None:
    bias = self.logit_bias
    _check(bias is None or (isinstance(bias, dict) and all(_is_int(t) and t >= 0 for t in bias)), "logit_bias",
           "logit_bias must map non-negative token ids to numbers")
    for token, value in (bias or {}).items():
      _check(_is_number(value) and math.isfinite(value) and -100 <= value <= 100, "logit_bias",
             f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
    allowed = self.allowed_token_ids
    _check(allowed is None or (isinstance(allowed, list) and len(allowed) > 0 and all(_is_int(t) and t >= 0 for t in allowed)),
           "allowed_token_ids", f"allowed_token_ids must be a non-empty list of non-negative token ids, got {allowed!r}")
    _check(self.bad_words is None or (isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
           "bad_words", f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
    _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
    _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
           f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
    _check(self.extra_args is None or (isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args)),
           "extra_args", "extra_args must be a dict with string keys")

  @property
  def greedy(self) -> bool: return self.temperature == 0

  @property
  def uses_penalties(self) -> bool:
    return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

  @property
  def uses_filters(self) -> bool: return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

  @property
  def bad_words_token_ids(self) -> list[list[int]]:
    """Each bad word's tokens (as the input processor tokenized them; empty before)."""
    return self._bad_words_token_ids or []

  @property
  def needs_output_on_host(self) -> bool:
    """Whether preparing a step's row needs every earlier output token on the host: penalties count them, a bad word
    of several tokens is banned after its other tokens. (Structured output needs them later, for the mask: its grammar
    advances with each token as it lands, before the next step's launch fills the mask.)"""
    return self.uses_penalties or any(len(ids) > 1 for ids in self.bad_words_token_ids)


MAX_BEAM_WIDTH = 10   # each beam's candidates are its 2 x beam_width top logprobs, and a step returns at most 20


@dataclass
class BeamSearchParams:
  """How LLM.beam_search searches (vLLM's BeamSearchParams), validated at construction.

  Each of max_tokens steps extends every live beam by its 2 x beam_width most probable next tokens (and, with
  temperature > 0, the token sampled at that temperature when it is not among them, as vLLM's); a beam whose token is
  EOS is complete (unless ignore_eos), the beam_width best of the others live on. A beam's score is its cumulative
  logprob / len ** length_penalty, len counting the prompt's tokens (and not a final EOS). include_stop_str_in_output:
  a complete beam's text ends with its EOS token's text."""
  beam_width: int
  max_tokens: int
  ignore_eos: bool = False
  temperature: float = 0.0
  length_penalty: float = 1.0
  include_stop_str_in_output: bool = False

  def __post_init__(self) -> None:
    _check(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
           f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
    _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
    _check_in(self.temperature, "temperature", 0, FLOAT32_MAX)
    _check(_is_number(self.length_penalty) and math.isfinite(self.length_penalty), "length_penalty",
           f"length_penalty must be a finite number, got {self.length_penalty!r}")
    for name in ("ignore_eos", "include_stop_str_in_output"):
      _check(isinstance(getattr(self, name), bool), name, f"{name} must be a bool, got {getattr(self, name)!r}")

  @property
  def num_candidates(self) -> int:
    """The top logprobs each beam's step asks for."""
    return 2 * self.beam_width
