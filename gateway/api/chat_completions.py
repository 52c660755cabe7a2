"""POST /v1/chat/completions: parse and authenticate, admit (gateway/admission), then answer as
JSON or as OpenAI's server-sent events, decoded on the token-level path or passed through whole."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from gateway import observability
from gateway.admission.chat import admit
from gateway.api.routes import authenticate, runtime_of
from gateway.api.started import StartedAnswer, answer_of
from gateway.runtime import Runtime
from gateway.wire.errors import ClientClosedRequest, GatewayError, InvalidRequest, param_of, quoted, sse_error_event
from gateway.wire.request_body import parse_json_body, read_body
from gateway.wire.schemas import ChatCompletionRequest

log = logging.getLogger("gateway.api.chat_completions")
router = APIRouter()
B = TypeVar("B", bound=BaseModel)


async def parse_body(request: Request, model: type[B]) -> B:
    """The request's JSON body as `model`, within the server's size, depth and time limits; a 400
    that names the field otherwise (a 408 past `body_timeout_s`, see `read_body`)."""
    server = runtime_of(request).settings.server
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > server.max_body_bytes:
        raise InvalidRequest(f"request body exceeds {server.max_body_bytes} bytes")
    try:
        raw = await read_body(request.stream(), server.max_body_bytes, server.body_timeout_s)
    except ClientDisconnect as exc:
        raise ClientClosedRequest("the client closed the connection before sending the whole body") from exc
    data = parse_json_body(raw, server.max_body_bytes, server.max_body_depth)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {quoted(str(error['loc'][-1]))}"
        raise InvalidRequest(message, param=param_of(tuple(error["loc"]), error["type"] == "extra_forbidden")) from exc


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    runtime = runtime_of(request)
    tenant = authenticate(request)
    body = await parse_body(request, ChatCompletionRequest)
    observability.note_model(body.model)
    answer = answer_of(await admit(runtime, tenant, body))
    if body.stream:
        chunks = await answer.open_chunks()
        return event_stream(runtime, answer, sse_stream(runtime, answer, chunks))
    return JSONResponse(await answer.whole(request), headers=answer.headers(), background=shadow_task(runtime, answer))


def event_stream(runtime: Runtime, answer: StartedAnswer, events: AsyncIterator[dict]) -> EventSourceResponse:
    """The server-sent events response of a started request (chat, Responses, completions)."""
    # On SIGTERM, sse-starlette would cut streams at once; the grace period lets them finish. The
    # background task frees the slot even when the client left before the stream started.
    return EventSourceResponse(events, sep="\n", ping=15, headers=answer.headers(),
                               shutdown_grace_period=runtime.settings.server.drain_seconds,
                               background=BackgroundTask(answer.release))


async def offer_shadow(runtime: Runtime, answer: StartedAnswer) -> None:
    """Offer a finished token-level answer for a shadow answer (gateway/shadow). Called only once
    the client has the whole answer; it never waits for the shadow call."""
    case = answer.shadow_case() if runtime.shadow is not None else None
    if case is not None:
        runtime.shadow.offer(case)


def shadow_task(runtime: Runtime, answer: StartedAnswer) -> BackgroundTask | None:
    """`offer_shadow` as a JSON response's background task: it runs after the body is sent."""
    return BackgroundTask(offer_shadow, runtime, answer) if runtime.shadow is not None else None


async def finish_stream(runtime: Runtime, answer: StartedAnswer) -> None:
    """`finish` a stream, then `offer_shadow` it: the stream has ended, the client has it all."""
    await answer.finish()
    await offer_shadow(runtime, answer)


def sse_stream(runtime: Runtime, answer: StartedAnswer, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The SSE events of a started request's chunks (see `framed`); `finish_stream` runs at the end."""
    return framed(chunks, answer.id, answer.failure, lambda: finish_stream(runtime, answer))


async def framed(chunks: AsyncIterator[dict], request_id: str, failure: str, done):
    """SSE framing for both paths: the chunks, then [DONE]. An error after the stream started is
    one error event (never a crash); `done()` runs however the stream ends."""
    try:
        async for body in chunks:
            yield _event(body)
        yield {"data": "[DONE]"}
    except GatewayError as error:
        yield sse_error_event(error)
    except Exception:  # noqa: BLE001 - the stream has started: report, don't crash
        log.exception("error while streaming %s", request_id)
        yield sse_error_event(GatewayError(failure))
    finally:
        # A client that left closes this generator: close the chunks too (their own clean-up
        # runs now, not at garbage collection); the shield lets the slot's release finish.
        await asyncio.shield(chunks.aclose())
        await asyncio.shield(done())


def _event(body: dict) -> dict:
    return {"data": json.dumps(body, ensure_ascii=False)}
