"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, for everything the server refuses."""
from __future__ import annotations

import json
from typing import Any, TypeVar

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm.entrypoints.unsupported import RefusedField, implemented_fields

M = TypeVar("M", bound=BaseModel)

_STATUS_CODES = {400: "bad_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                 415: "unsupported_media_type", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
               error_type: str | None = None, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
    self.type = error_type or ("server_error" if status >= 500 else "invalid_request_error")

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

  def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(self.body(), status_code=self.status, headers={**(self.headers or {}), **(headers or {})})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
  return APIError(400, message, param, code)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(loc: tuple[Any, ...]) -> list[str]:
  """A pydantic error location without "body" and without the union-member tags ("str", "list[int]", ...)."""
  return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p))]


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
  """The first pydantic error, with its top-level field as `param` and the path in the message."""
  if not errors: return bad_request("invalid request")
  first = errors[0]
  if first.get("type") == "json_invalid": return bad_request(f"the body is not valid JSON: {first.get('msg')}")
  path = _field_path(first.get("loc", ()))
  if not path: return bad_request(f"the request body must be a JSON object: {first.get('msg')}")
  same_field = {e.get("msg") for e in errors if _field_path(e.get("loc", ()))[:1] == path[:1]}
  if len(same_field) > 1:   # a union: say that none of its forms fit
    return bad_request(f"{path[0]}: invalid value (accepted forms: {'; '.join(sorted(m for m in same_field if m))})", param=path[0])
  return bad_request(f"{'.'.join(path)}: {first.get('msg')}", param=path[0])


def check_json_media_type(content_type: str | None) -> None:
  """Bodies are JSON, said so (a 415 otherwise): a web page's form post or text/plain "simple request" never reaches a
  route."""
  media_type = (content_type or "").split(";")[0].strip().lower()
  if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")): return
  got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
  raise APIError(415, f"the request body must be JSON sent as Content-Type: application/json (got {got})",
                 code="unsupported_media_type")


async def parse_request(model: type[M], request: Request) -> M:
  """The request's JSON body as `model` (parse_body), once its Content-Type says JSON."""
  check_json_media_type(request.headers.get("content-type"))
  return parse_body(model, await request.body())


def parse_body(model: type[M], body: bytes) -> M:
  """The request body as `model`, or a 400 naming what is wrong: not JSON (or nested deeper than 200 levels, or with a
  number no float or 4,300-digit integer holds), a bad value, a field the server does not implement
  (tinyvllm/entrypoints/unsupported.py), a field it does not know."""
  try:
    data = pydantic_core.from_json(body, allow_inf_nan=False)
  except ValueError as e:
    raise bad_request(f"the body is not valid JSON: {e}") from None
  if not isinstance(data, dict): raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
  try:
    data = implemented_fields(model, data)
  except RefusedField as e:
    raise bad_request(str(e), e.param, e.code) from None
  try:
    return model.model_validate_json(json.dumps(data))
  except ValidationError as e:
    raise from_validation_errors(e.errors()) from None


def install_error_handlers(app: FastAPI) -> None:
  @app.exception_handler(APIError)
  async def api_error(_: Request, e: APIError) -> JSONResponse: return e.response()

  @app.exception_handler(RequestValidationError)
  async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return from_validation_errors(list(e.errors())).response()

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}
    err = APIError(e.status_code, message.get(e.status_code, str(e.detail)), code=_STATUS_CODES.get(e.status_code))
    return err.response(headers=getattr(e, "headers", None))
