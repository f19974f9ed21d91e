"""The frontend's side of a new request (vLLM v1's Processor): tokenize the prompt, refuse what could never run (from
the facts the core reported: context length, KV cache size, vocabulary) and make the EngineCoreRequest. It also loads
what the frontend needs from the model folder: the tokenizer and the generation-config sampling defaults."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.core.scheduling_policy import check_priority
from tinyvllm.engine.core_setup import log
from tinyvllm.engine.generation_config import default_sampling_params
from tinyvllm.engine.messages import EngineCoreInfo, EngineCoreRequest
from tinyvllm.engine.structured_outputs import check_grammar
from tinyvllm.model.gguf.config import gguf_model_config, is_gguf_path
from tinyvllm.model.gguf.hub import gguf_model_file, is_hub_gguf
from tinyvllm.model.gguf.reader import GGUFFile
from tinyvllm.model.gguf.tokenizer import gguf_tokenizer
from tinyvllm.model.hub import resolve_model, resolve_tokenizer
from tinyvllm.model.presets import PRESETS
from tinyvllm.model_config import ModelConfig
from tinyvllm.sampling_params import SamplingParams, SamplingParamsError
from tinyvllm.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from tinyvllm.worker.logits_processors import processor_class

PromptType = str | list[int] | dict
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class PromptError(ValueError):
  """A request cannot be served as given (empty, too long for the context or the cache, not tokenizable)."""


@dataclass
class FrontendFiles:
  """What the frontend reads from the model folder."""
  tokenizer: Tokenizer | None
  default_sampling_params: dict[str, Any]


def model_folder(config: EngineConfig) -> Path | None:
  """The model's folder for its tokenizer and configs (no weights fetched); None for a dummy preset or a GGUF file."""
  if config.load_format == "dummy" and config.model in PRESETS: return None
  if is_gguf_path(config.model) or is_hub_gguf(config.model): return None
  return resolve_model(config.model, config.hub_settings(), config.revision, weights=False)


def load_frontend_files(config: EngineConfig, folder: Path | None) -> FrontendFiles:
  """The tokenizer (checked against the model's vocabulary) and the sampling defaults: no weights are read, so that a
  tokenizer problem shows before the weights load."""
  gguf = gguf_model(config)
  tokenizer = _tokenizer(config, folder, gguf)
  if tokenizer is not None: check_tokenizer_fits(tokenizer, *_model_vocab_size(config, folder, gguf))
  return FrontendFiles(tokenizer, _sampling_defaults(config, folder))


def _model_vocab_size(config: EngineConfig, folder: Path | None, gguf: GGUFFile | None) -> tuple[int, str]:
  """(the model's vocab_size, where it is written), from its config alone: a GGUF file's metadata, a preset or config.json."""
  if gguf is not None: return gguf_model_config(gguf).vocab_size, f"{config.model}'s metadata"
  if folder is None: return int(PRESETS[config.model]["vocab_size"]), f"preset {config.model}"
  return ModelConfig.from_folder(folder).vocab_size, str(folder / "config.json")


def check_tokenizer_fits(tokenizer: Tokenizer, vocab_size: int, source: str) -> None:
  """Refuse a tokenizer with ids beyond the model's embedding rows (another model's tokenizer): its ids would index past
  the embeddings. A model with more rows than the tokenizer has ids (padding, common) is fine."""
  if tokenizer.vocab_size > vocab_size:
    raise TokenizerError(f"the tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} token ids (with its added tokens) but the "
                         f"model's vocabulary has {vocab_size} (vocab_size in {source}): it is not this model's tokenizer")


def _sampling_defaults(config: EngineConfig, folder: Path | None) -> dict[str, Any]:
  """The defaults requests take for the sampling fields they leave unset (vLLM's generation-config handling)."""
  defaults, origin = default_sampling_params(config, folder)
  if defaults: log(f"default sampling parameters from {origin}: {defaults} (--generation-config vllm ignores the model's)")
  return defaults


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
  """vLLM's tokenization of bad words: each word (leading spaces stripped) alone and after a space, the second only
  where the space makes a different word of as many tokens."""
  out: list[list[int]] = []
  for word in words:
    alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    out.append(alone)
    if spaced[0] != alone[0] and len(spaced) == len(alone): out.append(spaced)
  return out


def engine_tokenizer(config: EngineConfig) -> Tokenizer | None:
  """The frontend's tokenizer, loaded again (the engine core's structured output builds its grammars' tokenizer on it)."""
  return _tokenizer(config, model_folder(config), gguf_model(config))


def gguf_model(config: EngineConfig) -> GGUFFile | None:
  """The GGUF model --model names (a local file, or REPO_ID:QUANT_TYPE on the hub); None for any other model."""
  path = gguf_model_file(config.model, config.hub_settings(), config.revision)
  return None if path is None else GGUFFile(path)


def _tokenizer(config: EngineConfig, folder: Path | None, gguf: GGUFFile | None) -> Tokenizer | None:
  """--tokenizer, else the model folder's own; a folder without tokenizer files serves token-id prompts only."""
  if config.skip_tokenizer_init:
    log("skip_tokenizer_init: no tokenizer, prompts must be token ids and outputs carry no text")
    return None
  if (tokenizer_folder := resolve_tokenizer(config)) is not None: return load_tokenizer(tokenizer_folder)
  if gguf is not None: return gguf_tokenizer(gguf)
  if folder is None or not any((folder / f).exists() for f in TOKENIZER_FILES):
    log("no tokenizer: prompts must be token ids")
    return None
  return load_tokenizer(folder)


class InputProcessor:
  def __init__(self, info: EngineCoreInfo, tokenizer: Tokenizer | None, max_logprobs: int, scheduling_policy: str = "fcfs",
               logits_processors: list[str | type] | None = None):
    """logits_processors: the engine's custom processors (classes or qualified names), whose validate_params each
    request passes."""
    self.info, self.tokenizer, self.max_logprobs, self.scheduling_policy = info, tokenizer, max_logprobs, scheduling_policy
    self.logits_processors = [processor_class(spec) for spec in logits_processors or []]
    tokenizer_eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
    self.eos_token_ids = sorted(frozenset(info.eos_token_ids) | tokenizer_eos)

  def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(the prompt's text if it has one, its token ids)."""
    if isinstance(prompt, dict):
      if "prompt_token_ids" in prompt: return prompt.get("prompt"), self.tokenize_prompt(list(prompt["prompt_token_ids"]))[1]
      if "prompt" not in prompt: raise PromptError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
      prompt = prompt["prompt"]
    if isinstance(prompt, str):
      if self.tokenizer is None: raise PromptError("this model has no tokenizer: pass token ids, or --tokenizer")
      return prompt, self.tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      bad = [t for t in prompt if not 0 <= t < self.info.vocab_size]
      if bad: raise PromptError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {self.info.vocab_size})")
      return None, list(prompt)
    raise PromptError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

  def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
    """Refuse, before anything is allocated, what could never run."""
    if not prompt_ids: raise PromptError("the prompt is empty (no tokens)")
    n, limit = len(prompt_ids), self.info.max_model_len
    if n >= limit: raise PromptError(f"prompt has {n} tokens, the model's context is {limit}: no room to generate")
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
    if n + max_tokens > limit:
      raise PromptError(f"prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} exceeds "
                        f"the model's context of {limit} tokens")
    need = self._blocks_needed(n, max_tokens, params.n)
    if need > self.info.num_kv_blocks:
      raise PromptError(f"request needs {need} KV cache blocks ({n} prompt + {max_tokens} new tokens, n={params.n}) "
                        f"but the whole cache holds {self.info.num_kv_blocks}")
    if params.stop_strings and self.tokenizer is None:
      raise SamplingParamsError("stop", "stop strings need a tokenizer and this model has none (stop_token_ids work without)")
    self._check_token_controls(params)
    for name in ("logprobs", "prompt_logprobs"):
      wanted = getattr(params, name)
      if wanted is not None and wanted > self.max_logprobs:
        raise SamplingParamsError(name, f"{name}={wanted} is more than max_logprobs ({self.max_logprobs})")

  def _check_token_controls(self, params: SamplingParams) -> None:
    """Token ids within the vocabulary; bad words and structured output need the tokenizer; the grammar compiles."""
    vocab = self.info.vocab_size
    for name, ids in (("logit_bias", list(params.logit_bias or {})), ("allowed_token_ids", params.allowed_token_ids or [])):
      if bad := [t for t in ids if t >= vocab]:
        raise SamplingParamsError(name, f"{name} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
    for name in ("bad_words", "structured_outputs"):
      if getattr(params, name) and self.tokenizer is None:
        raise SamplingParamsError(name, f"{name} needs a tokenizer and this model has none")
    if params.structured_outputs is not None: check_grammar(params.structured_outputs)
    for processor in self.logits_processors:
      try: processor.validate_params(params)
      except ValueError as e: raise SamplingParamsError("extra_args", f"{processor.__qualname__}: {e}") from None

  def _blocks_needed(self, prompt_len: int, max_tokens: int, n: int) -> int:
    if not self.info.paged: return n   # a contiguous row per sample
    blocks = lambda tokens: -(-tokens // self.info.block_size)
    return blocks(prompt_len) + n * (blocks(prompt_len + max_tokens) - blocks(prompt_len) + 1)

  def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
              priority: int = 0) -> tuple[str | None, EngineCoreRequest]:
    """Tokenize and check a request; (its prompt text, the request for the core). The caller's params are not changed."""
    check_priority(priority, self.scheduling_policy)
    text, prompt_ids = self.tokenize_prompt(prompt)
    self.check_request(prompt_ids, params)
    if params.max_tokens is None: params = dataclasses.replace(params, max_tokens=self.info.max_model_len - len(prompt_ids))
    if params.bad_words and self.tokenizer is not None:
      params = dataclasses.replace(params, _bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))
    return text, EngineCoreRequest(request_id, prompt_ids, params, self.eos_token_ids, time.time(), priority)
