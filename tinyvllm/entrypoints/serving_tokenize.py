"""GET /v1/models, POST /tokenize and POST /detokenize (vLLM's shapes)."""
from __future__ import annotations

from typing import Any

from tinyvllm.entrypoints.chat_tools import check_tools
from tinyvllm.entrypoints.common import ServerState
from tinyvllm.entrypoints.errors import bad_request
from tinyvllm.entrypoints.protocol import DetokenizeRequest, TokenizeRequest
from tinyvllm.entrypoints.serving_chat import render_chat


def list_models(state: ServerState) -> dict[str, Any]:
  card: dict[str, Any] = {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "tinyvllm",
                          "root": state.model_path}
  if state.engine is not None: card.update(max_model_len=state.engine.max_model_len, vocab_size=state.engine.vocab_size)
  return {"object": "list", "data": [card]}


def tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
  state.require_ready()
  state.check_model(req.model)
  if (req.prompt is None) == (req.messages is None): raise bad_request("give exactly one of prompt and messages", "prompt")
  tokenizer = state.tokenizer("tokenize")
  if req.prompt is not None:
    ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
  else:
    if req.tools: check_tools(req.tools)
    text = render_chat(state, req, [t.model_dump(exclude_unset=True) for t in req.tools or []])
    ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
  return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
  state.require_ready()
  state.check_model(req.model)
  vocab = state.require_engine().vocab_size
  if bad := [t for t in req.tokens if not 0 <= t < vocab]: raise bad_request(f"token ids {bad[:5]} are outside [0, {vocab})", "tokens")
  return {"prompt": state.tokenizer("detokenize").decode(req.tokens)}
