"""Tool parsers (`--tool-call-parser`, vLLM's names): the tool calls a model writes in its text, read out of it."""
from __future__ import annotations

from tinyvllm.entrypoints.tool_parsers.abstract import ToolCallDelta, ToolParser
from tinyvllm.entrypoints.tool_parsers.forced import NamedToolCall, RequiredToolCalls
from tinyvllm.entrypoints.tool_parsers.hermes import HermesToolParser
from tinyvllm.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "NamedToolCall", "RequiredToolCalls", "ToolCallDelta",
           "ToolParser"]
