"""POST /v1/chat/completions: parse and authenticate, admit (gateway/admission), then answer as
JSON or as OpenAI's server-sent events, decoded on the token-level path or passed through whole."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from gateway import observability
from gateway.admission.chat import Admitted, admit
from gateway.admission.passthrough import Passing
from gateway.api.errors import ClientClosedRequest, GatewayError, InvalidRequest, param_of, quoted, sse_error_event
from gateway.api.request_body import parse_json_body
from gateway.api.responses import chunk, completion_body, routing_header, usage_chunk
from gateway.api.routes import authenticate, runtime_of
from gateway.api.schemas import ChatCompletionRequest
from gateway.decoding.decoder import Piece
from gateway.runtime import Runtime

log = logging.getLogger("gateway.api.chat_completions")
router = APIRouter()


async def parse_chat_request(request: Request) -> ChatCompletionRequest:
    server = runtime_of(request).settings.server
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > server.max_body_bytes:
        raise InvalidRequest(f"request body exceeds {server.max_body_bytes} bytes")
    data = parse_json_body(await request.body(), server.max_body_bytes, server.max_body_depth)
    try:
        return ChatCompletionRequest.model_validate(data)
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
    body = await parse_chat_request(request)
    observability.note_model(body.model)
    admitted = await admit(runtime, tenant, body)
    if isinstance(admitted, Passing):
        return await _pass_through(request, runtime, admitted)
    if body.stream:
        # On SIGTERM, sse-starlette would cut streams at once; the grace period lets them finish.
        # The background task frees the slot even when the client left before the stream started.
        return EventSourceResponse(_stream(runtime, admitted), sep="\n", ping=15,
                                   shutdown_grace_period=runtime.settings.server.drain_seconds,
                                   background=BackgroundTask(admitted.release, runtime))
    try:
        pieces = await _unless_client_leaves(request, _collect(admitted))
    finally:
        await asyncio.shield(admitted.release(runtime))
    return JSONResponse(completion_body(admitted, pieces), headers={"x-routing-summary": routing_header(admitted)})


async def _pass_through(request: Request, runtime: Runtime, passing: Passing):
    """A request the local model cannot serve, answered whole by the upstream."""
    headers = {"x-routing-summary": passing.header()}
    if passing.body.stream:
        try:
            chunks = await passing.open_stream()
        except BaseException:
            await asyncio.shield(passing.release(runtime))
            raise
        return EventSourceResponse(_passed_events(runtime, passing, chunks), sep="\n", ping=15, headers=headers,
                                   shutdown_grace_period=runtime.settings.server.drain_seconds,
                                   background=BackgroundTask(passing.release, runtime))
    try:
        body = await _unless_client_leaves(request, passing.complete())
    finally:
        await asyncio.shield(passing.release(runtime))
        observability.count_passthrough(passing)
    return JSONResponse(body, headers=headers)


def _passed_events(runtime: Runtime, passing: Passing, chunks):
    async def done() -> None:
        await passing.release(runtime)
        observability.count_passthrough(passing)

    events = (_event(body) async for body in chunks)
    return _framed(events, passing.id, "the upstream's stream failed; the gateway logged the details", done)


async def _collect(admitted: Admitted) -> list[list[Piece]]:
    """Each choice's pieces."""
    pieces: list[list[Piece]] = [[] for _ in admitted.decodings]
    async for index, piece in observability.metered(admitted):
        pieces[index].append(piece)
    return pieces


async def _unless_client_leaves(request: Request, work):
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


def _stream(runtime: Runtime, admitted: Admitted):
    return _framed(_decoded_events(admitted), admitted.id,
                   "internal error while decoding; the gateway logged the details", lambda: admitted.release(runtime))


async def _decoded_events(admitted: Admitted):
    """Per choice the role, one delta per piece (finish_reason on the last), then usage."""
    for index in range(len(admitted.decodings)):
        yield _event(chunk(admitted, {"role": "assistant", "content": ""}, index=index))
    last: dict[int, Piece] = {}  # each choice's newest piece, held back to carry finish_reason
    async for index, piece in observability.metered(admitted):
        if not piece.text:
            continue  # nothing showable yet (a split character or a possible stop string)
        if index in last:
            yield _event(chunk(admitted, {"content": last[index].text}, piece=last[index], index=index))
        last[index] = piece
    for index, decoding in enumerate(admitted.decodings):
        held = last.get(index)
        delta = {"content": held.text} if held else {}
        yield _event(chunk(admitted, delta, finish_reason=decoding.finish_reason, piece=held, index=index))
    options = admitted.body.stream_options
    if options is not None and options.include_usage:
        yield _event(usage_chunk(admitted))


async def _framed(events, request_id: str, failure: str, done):
    """SSE framing for both paths: the events, then [DONE]. An error after the stream started is
    one error event (never a crash); `done()` runs however the stream ends."""
    try:
        async for event in events:
            yield event
        yield {"data": "[DONE]"}
    except GatewayError as error:
        yield sse_error_event(error)
    except Exception:  # noqa: BLE001 - the stream has started: report, don't crash
        log.exception("error while streaming %s", request_id)
        yield sse_error_event(GatewayError(failure))
    finally:
        # A client that left closes this generator: close the events too (their own clean-up
        # runs now, not at garbage collection); the shield lets the slot's release finish.
        await asyncio.shield(events.aclose())
        await asyncio.shield(done())


def _event(body: dict) -> dict:
    return {"data": json.dumps(body, ensure_ascii=False)}
