"""LLM: the offline API (vLLM's names): generate, a streaming form, chat and beam_search."""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm import tqdm

from tinyvllm.beam_search import BeamSearchOutput
from tinyvllm.engine.beam_search import candidates, start_search, step_params
from tinyvllm.engine.input_processor import FrontendFiles
from tinyvllm.engine.llm_engine import LLMEngine, PromptError, PromptType, log
from tinyvllm.engine_args import engine_config
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from tinyvllm.tokenizer import HFStyleTokenizer
from tinyvllm.tokenizer.chat_template import parse_tool_call_arguments

_ids = itertools.count()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
  """One prompt (a string, a list of token ids, a dict) or a list of them."""
  if isinstance(prompts, (str, dict)): return [prompts]
  if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts): return [list(prompts)]
  return list(prompts)


class LLM:
  def __init__(self, model: str, *, check_frontend_files: Callable[[FrontendFiles], None] | None = None, **engine_args: Any):
    """engine_args: vLLM's engine arguments (tinyvllm/engine_args.py says what each does here; one tinyvllm cannot
    honour is refused, naming it) and tinyvllm's own EngineConfig fields (kv_cache, scheduler, attention_backend, ...).
    As vLLM's LLM, it logs no periodic stats unless disable_log_stats=False. check_frontend_files (tinyvllm's): called
    with the tokenizer and sampling defaults before the weights load (LLMEngine's)."""
    config = engine_config(model, {"disable_log_stats": True, **engine_args}, log)
    self.engine = LLMEngine(config, check_frontend_files)
    self._tokenizer = HFStyleTokenizer(self.engine.tokenizer) if self.engine.tokenizer is not None else None

  def get_tokenizer(self) -> HFStyleTokenizer | None:
    """The tokenizer with HF transformers' methods and defaults (None with skip_tokenizer_init)."""
    return self._tokenizer

  def get_default_sampling_params(self) -> SamplingParams:
    """SamplingParams with the model's generation_config.json defaults (vLLM's), used when none are given."""
    return SamplingParams(**self.engine.default_sampling_params)

  def _add_all(self, prompts: list[PromptType], params: SamplingParams | Sequence[SamplingParams] | None,
               output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, priority: Sequence[int] | None = None) -> list[str]:
    """Validate every prompt first so that a bad one leaves nothing queued, then add them all."""
    plist = list(params) if isinstance(params, (list, tuple)) else [params or self.get_default_sampling_params()] * len(prompts)
    if len(plist) != len(prompts): raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
    priorities = list(priority) if priority is not None else [0] * len(prompts)
    if len(priorities) != len(prompts): raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
    for p in priorities: self.engine.check_priority(p)
    plist = [dataclasses.replace(p, output_kind=output_kind) for p in plist]   # the caller's objects stay as they were
    for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
      try: self.engine.check_request(self.engine.tokenize_prompt(prompt)[1], p)
      except PromptError as e: raise PromptError(f"prompt {i}: {e}") from None
    ids = [f"offline-{next(_ids)}" for _ in prompts]
    for rid, prompt, p, rank in zip(ids, prompts, plist, priorities, strict=True): self.engine.add_request(rid, prompt, p, rank)
    return ids

  def generate(self, prompts: PromptType | Sequence[PromptType],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
    """priority: one per prompt (vLLM's; scheduling_policy priority only): lower values are served first."""
    ids = self._add_all(_as_prompt_list(prompts), sampling_params, RequestOutputKind.FINAL_ONLY, priority)
    finals: dict[str, RequestOutput] = {}
    start, generated = time.perf_counter(), 0
    with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
      try:
        while self.engine.has_unfinished_requests():
          for out in self.engine.step():   # finished requests only (FINAL_ONLY)
            generated += sum(len(o.token_ids) for o in out.outputs)
            finals[out.request_id] = out
            bar.update(1)
          bar.set_postfix_str(f"{generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s")
      except BaseException:
        for rid in ids: self.engine.abort_request(rid)
        raise
    return [finals[rid] for rid in ids]

  def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                  use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """vLLM's: each prompt's params.beam_width best continuations (tinyvllm/beam_search.py), every prompt's beams
    stepping together. Every prompt is checked before anything runs."""
    searches = []
    for i, prompt in enumerate(_as_prompt_list(prompts)):
      try: searches.append(start_search(self.engine.processor, prompt, params)[1])
      except PromptError as e: raise PromptError(f"prompt {i}: {e}") from None
    step = step_params(params)
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm, dynamic_ncols=True):
      beams = [beam for search in searches for beam in search.beams]
      if not beams: break   # every candidate was EOS
      outputs = iter(self.generate([{"prompt_token_ids": beam.tokens} for beam in beams], step, use_tqdm=False))
      for search in searches: search.advance([candidates(next(outputs)) for _ in search.beams])
    tokenizer = self.engine.tokenizer
    decode = None if tokenizer is None else tokenizer.decode
    return [BeamSearchOutput(search.best(decode)) for search in searches]

  def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
    """Yields the completion's text as it is produced (first sample only)."""
    (rid,) = self._add_all([prompt], sampling_params)
    try:
      done = False
      while not done:
        for out in self.engine.step():
          if out.request_id != rid: continue
          if out.outputs[0].delta_text: yield out.outputs[0].delta_text
          done = out.finished
    finally:
      self.engine.abort_request(rid)

  def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
           use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
           continue_final_message: bool = False, tools: list[dict] | None = None,
           chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
    """One conversation (a list of messages) or several, rendered with the model's chat template (or `chat_template`,
    the template's source), as vLLM's: `tools` (OpenAI's function tools) reach the template, assistant messages' tool
    calls may carry their arguments as JSON strings, continue_final_message leaves the last message open for the
    model to go on writing (with add_generation_prompt=False). The output is the model's text: parsing tool calls
    out of it is the server's (--tool-call-parser)."""
    tokenizer = self.engine.tokenizer
    if tokenizer is None: raise PromptError("chat needs a tokenizer with a chat template")
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    prompts: list[PromptType] = []
    for conv in conversations:
      text = tokenizer.apply_chat_template(parse_tool_call_arguments(conv), add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, continue_final_message=continue_final_message,
                                           tools=tools, **(chat_template_kwargs or {}))
      prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
