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
from gateway.admission.chat import Admitted, admit
from gateway.api.chat_bodies import chunk, completion_body, routing_header, usage_chunk
from gateway.api.routes import authenticate, runtime_of
from gateway.decoding.decoder import Piece
from gateway.decoding.passing import Passing
from gateway.runtime import Runtime
from gateway.shadow.cases import case_of
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


Started = Admitted | Passing  # a request on the token-level path, or passed through whole


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    runtime = runtime_of(request)
    tenant = authenticate(request)
    body = await parse_body(request, ChatCompletionRequest)
    observability.note_model(body.model)
    started = await admit(runtime, tenant, body)
    if body.stream:
        chunks = await open_chunks(runtime, started)
        return event_stream(runtime, started, sse_stream(runtime, started, chunks))
    answer = await whole_answer(request, runtime, started)
    return JSONResponse(answer, headers=summary_headers(started), background=shadow_task(runtime, started))


def event_stream(runtime: Runtime, started: Started, events: AsyncIterator[dict]) -> EventSourceResponse:
    """The server-sent events response of a started request (chat, Responses, completions)."""
    # On SIGTERM, sse-starlette would cut streams at once; the grace period lets them finish. The
    # background task frees the slot even when the client left before the stream started.
    return EventSourceResponse(events, sep="\n", ping=15, headers=summary_headers(started),
                               shutdown_grace_period=runtime.settings.server.drain_seconds,
                               background=BackgroundTask(started.release))


async def whole_answer(request: Request, runtime: Runtime, started: Started) -> dict:
    """The chat.completion body of a started request (see `collected`)."""
    if isinstance(started, Passing):
        try:
            return await unless_client_leaves(request, started.complete())
        finally:
            await asyncio.shield(finish(runtime, started))
    return completion_body(started, await collected(request, runtime, started))


async def collected(request: Request, runtime: Runtime, admitted: Admitted) -> list[list[Piece]]:
    """Each choice's pieces of a token-level request; frees its slot however it ends, and stops
    decoding and upstream spending if the client leaves first."""
    try:
        return await unless_client_leaves(request, _collect(admitted))
    finally:
        await asyncio.shield(finish(runtime, admitted))


async def open_chunks(runtime: Runtime, started: Started) -> AsyncIterator[dict]:
    """A started request's answer as chat.completion.chunk bodies (the usage chunk when the request
    asked for it). A pass-through's upstream call starts here, so its refusal is still an HTTP
    error; the caller runs `finish` once the chunks end."""
    if isinstance(started, Admitted):
        return _decoded_chunks(started)
    try:
        return await started.open_stream()
    except BaseException:
        await asyncio.shield(started.release())
        raise


async def finish(runtime: Runtime, started: Started) -> None:
    """Free the request's parallel slot (once) and count a pass-through; run once per request."""
    await started.release()
    if isinstance(started, Passing):
        observability.count_passthrough(started)


async def offer_shadow(runtime: Runtime, started: Started) -> None:
    """Offer a finished token-level answer for a shadow answer (gateway/shadow). Called only once
    the client has the whole answer; it never waits for the shadow call."""
    if runtime.shadow is not None and isinstance(started, Admitted):
        runtime.shadow.offer(case_of(started))


def shadow_task(runtime: Runtime, started: Started) -> BackgroundTask | None:
    """`offer_shadow` as a JSON response's background task: it runs after the body is sent."""
    return BackgroundTask(offer_shadow, runtime, started) if runtime.shadow is not None else None


async def finish_stream(runtime: Runtime, started: Started) -> None:
    """`finish` a stream, then `offer_shadow` it: the stream has ended, the client has it all."""
    await finish(runtime, started)
    await offer_shadow(runtime, started)


def summary_headers(started: Started) -> dict[str, str]:
    """The `x-routing-summary` header (a token-level stream's summary is known only at its end)."""
    if isinstance(started, Passing):
        return {"x-routing-summary": started.header()}
    if started.body.stream:
        return {}
    return {"x-routing-summary": routing_header(started)}


def sse_stream(runtime: Runtime, started: Started, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The SSE events of a started request's chunks (see `framed`); `finish` runs at the end."""
    return framed(chunks, started.id, _failure(started), lambda: finish_stream(runtime, started))


def _failure(started: Started) -> str:
    if isinstance(started, Passing):
        return "the upstream's stream failed; the gateway logged the details"
    return "internal error while decoding; the gateway logged the details"


async def _collect(admitted: Admitted) -> list[list[Piece]]:
    """Each choice's pieces."""
    pieces: list[list[Piece]] = [[] for _ in admitted.decodings]
    async for index, piece in observability.metered(admitted):
        pieces[index].append(piece)
    return pieces


async def unless_client_leaves(request: Request, work):
    """Await `work`, but cancel it (no more decoding or upstream spending) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientClosedRequest("the client closed the connection before the answer was ready")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so `receive` waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _decoded_chunks(admitted: Admitted) -> AsyncIterator[dict]:
    """Per choice the role, one delta per piece (finish_reason on the last), then usage."""
    for index in range(len(admitted.decodings)):
        yield chunk(admitted, {"role": "assistant", "content": ""}, index=index)
    last: dict[int, Piece] = {}  # each choice's newest piece, held back to carry finish_reason
    async for index, piece in observability.metered(admitted):
        if not piece.text:
            continue  # nothing showable yet (a split character or a possible stop string)
        if index in last:
            yield chunk(admitted, {"content": last[index].text}, piece=last[index], index=index)
        last[index] = piece
    for index, decoding in enumerate(admitted.decodings):
        held = last.get(index)
        delta = {"content": held.text} if held else {}
        yield chunk(admitted, delta, finish_reason=decoding.finish_reason, piece=held, index=index)
    options = admitted.body.stream_options
    if options is not None and options.include_usage:
        yield usage_chunk(admitted)


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
