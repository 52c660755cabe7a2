"""The HTTP endpoints. Each handler is thin: parse, authenticate, delegate, render."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.background import BackgroundTask

from gateway import observability
from gateway.chat import Admitted, admit
from gateway.decoder import Piece
from gateway.errors import (
    ClientClosedRequest, Forbidden, GatewayError, InvalidRequest, Unauthenticated, param_of, quoted, sse_error_event,
)
from gateway.passthrough import Passing
from gateway.request_body import parse_json_body
from gateway.responses import chunk, completion_body, routing_header, usage_chunk
from gateway.runtime import Runtime
from gateway.schemas import ChatCompletionRequest
from gateway.tenants import Tenant

log = logging.getLogger("gateway.routes")
router = APIRouter()


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


def bearer_key(request: Request) -> str:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthenticated("Missing API key: send 'Authorization: Bearer <key>'.")
    return key.strip()


def authenticate(request: Request) -> Tenant:
    tenant = runtime_of(request).tenants.authenticate(bearer_key(request))
    if tenant is None:
        raise Unauthenticated("Incorrect API key provided.")
    return tenant


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
                                   background=BackgroundTask(admitted.leave, runtime))
    try:
        pieces = await _unless_client_leaves(request, _collect(admitted))
    finally:
        await asyncio.shield(admitted.leave(runtime))
    return JSONResponse(completion_body(admitted, pieces), headers={"x-routing-summary": routing_header(admitted)})


async def _pass_through(request: Request, runtime: Runtime, passing: Passing):
    """A request the local model cannot serve, answered whole by the upstream."""
    headers = {"x-routing-summary": passing.header()}
    if passing.body.stream:
        try:
            chunks = await passing.open_stream()
        except BaseException:
            await asyncio.shield(passing.leave(runtime))
            raise
        return EventSourceResponse(_passed_events(runtime, passing, chunks), sep="\n", ping=15, headers=headers,
                                   shutdown_grace_period=runtime.settings.server.drain_seconds,
                                   background=BackgroundTask(passing.leave, runtime))
    try:
        body = await _unless_client_leaves(request, passing.complete())
    finally:
        await asyncio.shield(passing.leave(runtime))
        observability.count_passthrough(passing)
    return JSONResponse(body, headers=headers)


def _passed_events(runtime: Runtime, passing: Passing, chunks):
    async def done() -> None:
        await passing.leave(runtime)
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
                   "internal error while decoding; the gateway logged the details", lambda: admitted.leave(runtime))


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


@router.get("/v1/models")
async def list_models(request: Request):
    runtime = runtime_of(request)
    tenant = authenticate(request)
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "routing-gateway",
         "local": alias.settings.local, "upstream": alias.settings.upstream,
         "routing": alias.settings.routing.model_dump(exclude_none=True)}
        for name, alias in runtime.aliases.items() if tenant.may_use(name)
    ]
    return {"object": "list", "data": data}


@router.get("/v1/usage")
async def tenant_usage(request: Request):
    tenant = authenticate(request)
    return await _usage(runtime_of(request), tenant)


@router.get("/admin/tenants/{tenant_id}/usage")
async def admin_usage(tenant_id: str, request: Request):
    runtime = runtime_of(request)
    key = bearer_key(request)
    if not runtime.tenants.is_admin(key):
        if runtime.tenants.authenticate(key) is not None:
            raise Forbidden("This endpoint needs the admin key.")
        raise Unauthenticated("Incorrect API key provided.")
    tenant = runtime.tenants.by_id.get(tenant_id)
    if tenant is None:
        error = InvalidRequest(f"no tenant '{quoted(tenant_id)}'", param="tenant_id")
        error.status, error.code = 404, "not_found"
        raise error
    return await _usage(runtime, tenant)


async def _usage(runtime: Runtime, tenant: Tenant) -> dict:
    from adapters.store import StoreUnavailable

    try:
        windows = await runtime.ledger.store.usage(tenant.id, runtime.ledger.clock())
    except StoreUnavailable as exc:
        error = GatewayError("the usage ledger is unreachable; retry shortly")
        error.status, error.code = 503, "store_unavailable"
        raise error from exc
    budgets = {"day": tenant.settings.daily, "month": tenant.settings.monthly}
    return {
        "tenant": tenant.id,
        "windows": [
            {**vars(w), "limits": budgets[w.period].model_dump()} for w in windows
        ],
    }


@router.get("/health/live")
async def live():
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(request: Request):
    runtime = runtime_of(request)
    store_ok = await runtime.ledger.store.ping()
    # sse-starlette flags uvicorn's SIGTERM (it drains streams on it); the lifespan then closes us.
    draining = AppStatus.should_exit or runtime.closed
    body = {
        "status": "draining" if draining else "ready",
        "store": "ok" if store_ok else "unavailable",
        "mode": "routing" if store_ok else "local_only",
        "unsettled_usage": runtime.ledger.unsettled,
        "unreleased_slots": runtime.ledger.unreleased,
        "queue_depth": {name: model.queue_depth for name, model in runtime.local_models.items()},
    }
    return JSONResponse(body, status_code=503 if draining else 200)
