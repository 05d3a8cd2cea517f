"""Server room: API errors and their OpenAI / Anthropic JSON shapes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

# OpenAI error "type" by HTTP status; Anthropic uses its own vocabulary.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 404: "invalid_request_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 503: "service_unavailable", 500: "server_error",
                 504: "timeout_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 504: "timeout_error"}


@dataclass(slots=True, eq=False)
class APIError(Exception):
    """An error answered to the client; `param` / `code` follow OpenAI's error object."""

    message: str
    status: int = 400
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The error JSON for `path`: Anthropic's shape on /v1/messages, OpenAI's elsewhere."""
    if is_anthropic_path(path):
        fallback = "api_error" if status >= 500 else "invalid_request_error"
        kind = _ANTHROPIC_TYPES.get(status, fallback)
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def stream_error(path: str, exc: APIError) -> str:
    """The SSE frame(s) that end a stream which failed after it started (the status line is long
    sent): Anthropic's `error` event on /v1/messages, the Responses API's `error` event on
    /v1/responses, else OpenAI's `data: {"error": ...}` followed by `data: [DONE]`."""
    body = error_body(path, exc.status, exc.message, exc.param, exc.code)
    if is_anthropic_path(path):
        return f"event: error\ndata: {json.dumps(body)}\n\n"
    if path.startswith("/v1/responses"):
        event = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
        return f"event: error\ndata: {json.dumps(event)}\n\n"
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, param, code), status_code=status,
                        headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence for pydantic's error list, and the offending field name."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type", "")
        if kind == "json_invalid":
            return f"Malformed JSON body: {err.get('msg', 'could not parse')}", None
        if kind == "extra_forbidden":
            parts.append(f"Unsupported parameter: '{'.'.join(loc)}'")
        elif kind == "missing":
            parts.append(f"Missing required parameter: '{'.'.join(loc)}'")
        else:
            where = ".".join(loc) or "body"
            parts.append(f"Invalid value for '{where}': {err.get('msg', 'invalid')}")
        if param is None and loc:
            param = loc[0]
    return "; ".join(parts) or "Invalid request", param


async def validation_handler(request: Request, exc: Exception) -> JSONResponse:
    # OpenAI answers 400 (not FastAPI's 422) for schema errors; so do we.
    assert isinstance(exc, RequestValidationError)
    message, param = _describe_validation(exc)
    return error_response(request.url.path, 400, message, param)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code, headers)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    status = int(getattr(exc, "status_code", 500))
    detail = getattr(exc, "detail", None) or "Error"
    if status == 404:
        detail = f"Not found: {request.method} {request.url.path}"
    return error_response(request.url.path, status, str(detail))


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request.url.path, 500, f"Internal server error: {type(exc).__name__}")
