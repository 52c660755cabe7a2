"""POST /v1/responses (and GET, DELETE of stored ones): OpenAI's Responses API, answered through
the chat completions path (same aliases, tenants, budgets, routing and pass-through)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from adapters.store import ResponseQuota
from gateway import observability
from gateway.admission.chat import admit
from gateway.api.chat_completions import event_stream, finish_stream, parse_body, shadow_task
from gateway.api.routes import authenticate, runtime_of
from gateway.api.started import StartedAnswer, answer_of
from gateway.responses.events import ResponseEvents
from gateway.responses.output import ResponseDraft, conversation_messages, response_of
from gateway.responses.request import ResponsesRequest, chat_request, input_messages
from gateway.responses.stored import StoredResponses
from gateway.runtime import Runtime
from gateway.tenancy.tenants import Tenant
from gateway.wire.errors import GatewayError

log = logging.getLogger("gateway.api.responses")
router = APIRouter()


def stored_responses(runtime: Runtime) -> StoredResponses:
    settings = runtime.settings.store
    quota = ResponseQuota(settings.responses_max_per_tenant, settings.responses_max_bytes_per_tenant)
    return StoredResponses(runtime.ledger.store, settings.responses_ttl_s, quota)


@router.post("/v1/responses")
async def create_response(request: Request):
    runtime = runtime_of(request)
    tenant = authenticate(request)
    body = await parse_body(request, ResponsesRequest)
    observability.note_model(body.model)
    turns = []
    if body.previous_response_id:
        previous = await stored_responses(runtime).get(tenant.id, body.previous_response_id, "previous_response_id")
        turns = previous["conversation"]
    turns = turns + input_messages(body.input)
    answer = answer_of(await admit(runtime, tenant, chat_request(body, turns)))
    draft = ResponseDraft(body)
    if body.stream:
        chunks = await answer.open_chunks()
        return event_stream(runtime, answer, _events(runtime, tenant, answer, chunks, draft, turns))
    response = response_of(draft, await answer.whole(request))
    await _keep(runtime, tenant, response, turns)
    return JSONResponse(response, headers=answer.headers(), background=shadow_task(runtime, answer))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    tenant = authenticate(request)
    return (await stored_responses(runtime_of(request)).get(tenant.id, response_id))["response"]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    tenant = authenticate(request)
    await stored_responses(runtime_of(request)).delete(tenant.id, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _keep(runtime: Runtime, tenant: Tenant, response: dict[str, Any], turns: list[dict[str, Any]]) -> None:
    """Store `response` if it asks to be; one that could not be kept says `store: false`."""
    if response["store"]:
        await stored_responses(runtime).put(tenant.id, response, turns + conversation_messages(response["output"]))


async def _events(runtime: Runtime, tenant: Tenant, answer: StartedAnswer, chunks: AsyncIterator[dict],
                  draft: ResponseDraft, turns: list[dict[str, Any]]):
    """The Responses event stream of a started request's chunks; an error after the stream started
    is one `error` event. The response is stored before response.completed goes out, so a client
    may continue the conversation as soon as it sees it."""
    events = ResponseEvents(draft)
    try:
        for event in events.start():
            yield _sse(event)
        async for chunk in chunks:
            for event in events.feed(chunk):
                yield _sse(event)
        finishing = events.finish()
        await _keep(runtime, tenant, events.final, turns)
        for event in finishing:
            yield _sse(event)
    except GatewayError as error:
        yield _sse(events.error(error.body()))
    except Exception:  # noqa: BLE001 - the stream has started: report, don't crash
        log.exception("error while streaming %s", draft.id)
        yield _sse(events.error(GatewayError("internal error while answering; the gateway logged the details").body()))
    finally:
        await asyncio.shield(chunks.aclose())  # a client that left: stop decoding and upstream spending now
        await asyncio.shield(finish_stream(runtime, answer))


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}
