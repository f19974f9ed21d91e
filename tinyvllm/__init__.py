"""tinyvllm: a small, fast, correct LLM inference engine on tinygrad, in the spirit of vLLM."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from tinyvllm.engine.llm import LLM
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.outputs import CompletionOutput, RequestOutput
  from tinyvllm.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

# Imported on first use, so that light submodules (the `bench serve` HTTP client) do not pull in the engine and tinygrad.
_LAZY = {"LLM": "tinyvllm.engine.llm", "LLMEngine": "tinyvllm.engine.llm_engine", "CompletionOutput": "tinyvllm.outputs",
         "RequestOutput": "tinyvllm.outputs", "SamplingParams": "tinyvllm.sampling_params"}


def __getattr__(name: str) -> Any:
  if name not in _LAZY: raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
  return getattr(importlib.import_module(_LAZY[name]), name)
