"""The request fields that shape the output, as SamplingParams fields: the token controls (OpenAI's logit_bias, whose
keys are token ids as strings; vLLM's allowed_token_ids, bad_words, min_tokens, vllm_xargs) and the output constraint,
from exactly one of OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs and vLLM's older
guided_json / guided_regex / guided_choice / guided_grammar. A constraint the grammar engine cannot compile is a 400
naming the field it came in."""
from __future__ import annotations

import json
from typing import Any

from tinyvllm.engine.structured_outputs import check_grammar
from tinyvllm.entrypoints.errors import bad_request
from tinyvllm.entrypoints.protocol import ResponseFormat, SamplingRequest
from tinyvllm.sampling_params import SamplingParamsError, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "structural_tag": "structural_tag"}
# a SamplingParams field's name in the request (the rest are the same)
REQUEST_NAMES = {"extra_args": "vllm_xargs"}


def token_controls(req: SamplingRequest) -> dict[str, Any]:
  """The token-control fields the request sets (SamplingParams checks their values)."""
  out: dict[str, Any] = {name: getattr(req, name) for name in ("allowed_token_ids", "bad_words", "min_tokens")
                         if getattr(req, name) is not None}
  if req.logit_bias:
    try: out["logit_bias"] = {int(token): bias for token, bias in req.logit_bias.items()}
    except ValueError: raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
  if req.vllm_xargs is not None: out["extra_args"] = req.vllm_xargs
  return out


def output_constraint(req: SamplingRequest) -> StructuredOutputsParams | None:
  """The request's output constraint (None: free text), compiled once to refuse what the grammar engine cannot."""
  given = _given(req)
  if len(given) > 1:
    raise bad_request(f"give one output constraint; the request has {', '.join(name for name, _ in given)}", given[1][0])
  if req.guided_whitespace_pattern is not None and not (given and "json" in given[0][1]):
    raise bad_request("guided_whitespace_pattern applies to a JSON schema (guided_json)", "guided_whitespace_pattern")
  if not given: return None
  name, fields = given[0]
  if req.guided_whitespace_pattern is not None: fields["whitespace_pattern"] = req.guided_whitespace_pattern
  try:
    params = StructuredOutputsParams(**fields)
    check_grammar(params)
  except SamplingParamsError as e: raise bad_request(f"{name}: {e}", name) from None
  return params


def _given(req: SamplingRequest) -> list[tuple[str, dict[str, Any]]]:
  """(field, StructuredOutputsParams fields) of each constraint the request gives."""
  given = []
  if req.response_format is not None and req.response_format.type != "text":
    given.append(("response_format", _response_format(req.response_format)))
  if req.structured_outputs is not None:
    fields = req.structured_outputs.model_dump(exclude={"disable_fallback"})
    given.append(("structured_outputs", {"json": fields.pop("json_"), **fields}))
  given += [(name, {key: getattr(req, name)}) for name, key in GUIDED.items() if getattr(req, name) is not None]
  return given


def _response_format(fmt: ResponseFormat) -> dict[str, Any]:
  if fmt.type == "json_object": return {"json_object": True}
  if fmt.type == "structural_tag":
    if not fmt.structures or not fmt.triggers:
      raise bad_request("response_format of type structural_tag needs structures and triggers", "response_format")
    structures = [{"begin": t.begin, "schema": t.schema_, "end": t.end} for t in fmt.structures]
    return {"structural_tag": json.dumps({"structures": structures, "triggers": fmt.triggers})}
  if fmt.json_schema is None or fmt.json_schema.schema_ is None:
    raise bad_request("response_format of type json_schema needs json_schema.schema (the JSON schema)", "response_format")
  return {"json": fmt.json_schema.schema_}
