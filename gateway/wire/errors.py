"""The gateway's exceptions and the one renderer of OpenAI's error envelope."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("gateway.wire.errors")

QUOTE_CHARS = 64  # the most of a client's own input an error message repeats
MESSAGE_CHARS = 2000  # the longest message (an upstream's own words included)


def quoted(text: str, limit: int = QUOTE_CHARS) -> str:
    """A client's input as an error message may repeat it: at most `limit` characters, and text that
    UTF-8 cannot encode (lone surrogates) escaped, so the error itself can always be sent."""
    cut = text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


class GatewayError(Exception):
    """An error a client sees: HTTP status, OpenAI `type` and `code`, and the offending `param`."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.headers = message, param, headers or {}

    def body(self) -> dict:
        param = None if self.param is None else quoted(self.param, QUOTE_CHARS * 2)
        return {"error": {"message": quoted(self.message, MESSAGE_CHARS), "type": self.type, "param": param,
                          "code": self.code}}


class InvalidRequest(GatewayError):
    status, type = 400, "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthenticated(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class Forbidden(GatewayError):
    status, type, code = 403, "invalid_request_error", "permission_denied"


class ModelNotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class RateLimited(GatewayError):
    status, type, code = 429, "requests", "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, headers={"retry-after": str(max(1, round(retry_after_s)))})


class QuotaExceeded(GatewayError):
    status, type, code = 429, "insufficient_quota", "insufficient_quota"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


class ClientClosedRequest(GatewayError):
    """The client left before the answer was ready (nginx's 499; nobody reads the body)."""

    status, type, code = 499, "invalid_request_error", "client_closed_request"


class Overloaded(GatewayError):
    status, type, code = 503, "server_error", "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers={"retry-after": str(max(1, round(retry_after_s)))})


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def sse_error_event(error: GatewayError) -> dict:
    """An error after the stream started: one `data: {"error": ...}` event."""
    return {"data": json.dumps(error.body())}


def param_of(location: tuple, last_is_field: bool = False) -> str | None:
    """pydantic's error location as OpenAI's param: ('messages', 0, 'content') -> messages[0].content.

    pydantic also names the union member it tried ('str', 'list[TextPart]'); those are not fields.
    The first name is always a field (a request's own key), and so is the last when
    `last_is_field` (an unknown key, which may look like a type name)."""
    parts: list[str] = []
    for index, item in enumerate(location):
        if item in ("body",) and not parts:
            continue
        last = index == len(location) - 1
        if isinstance(item, str) and parts and not (last and last_is_field) and _union_member(item):
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif parts:
            parts.append(f".{item}")
        else:
            parts.append(str(item))
    return "".join(parts) if parts else None


def _union_member(item: str) -> bool:
    return item in ("str", "int", "float", "bool", "none") or "[" in item or item[:1].isupper()


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as {"error": {...}}; never FastAPI's {"detail": ...}."""

    @app.exception_handler(GatewayError)
    async def _gateway(_: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        return error_response(InvalidRequest(first["msg"], param=param_of(tuple(first["loc"]))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = InvalidRequest if exc.status_code < 500 else GatewayError
        error = kind(str(exc.detail))
        error.status, error.code = exc.status_code, "not_found" if exc.status_code == 404 else None
        return error_response(error)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(GatewayError("internal error; the gateway logged the details"))
