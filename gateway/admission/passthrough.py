"""Requests the token-level path cannot serve go whole to the alias's upstream (query-level routing).

`blocker_of` names the first field that keeps a request off the token-level path. `admit` then
either refuses the request (a 400 that names the field and says why) or holds one budget
reservation for its prompt plus its answer tokens, for one upstream chat call that is settled to
what the upstream billed. Answers keep the upstream's shapes (tool calls, structured output,
streamed deltas) under the gateway's id and model name, with `usage.routing.mode: "passthrough"`
and the field that sent them there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from adapters.message_shapes import for_upstream
from adapters.store import Billed, Reservation
from adapters.upstream import Upstream, UpstreamBusy, UpstreamRejected, UpstreamUnavailable
from gateway.admission.budget import HandoffGate
from gateway.admission.limits import admit_rates, admit_tokens, release
from gateway.admission.tenants import Tenant
from gateway.api.errors import GatewayError, InvalidRequest, Overloaded, QuotaExceeded, quoted
from gateway.api.request_body import depth_of
from gateway.api.schemas import ChatCompletionRequest, MediaPart
from gateway.runtime import Alias, Runtime
from gateway.settings import ServerSettings

log = logging.getLogger("gateway.admission.passthrough")

RESERVATION_MARGIN_S = 30.0
UPSTREAM_ONLY = (  # request fields only an upstream can honour, and what each asks for
    ("tools", "tool calling"), ("tool_choice", "tool calling"), ("functions", "function calling"),
    ("function_call", "function calling"), ("audio", "audio output"), ("web_search_options", "web search"),
    ("moderation", "moderation"),
)
GATEWAY_FIELDS = {"model", "routing", "continue_final_message", "add_generation_prompt", "stream", "stream_options"}


MEDIA = {"image_url": "image", "input_audio": "audio", "file": "file"}


@dataclass(frozen=True)
class Blocker:
    """The field that keeps a request off the token-level path, and why. `reason` is the field's
    kind without indices (a bounded metric label); `param` names the very field, for the client
    and the logs."""

    param: str
    why: str
    kind: str | None = None

    @property
    def reason(self) -> str:
        return self.kind or self.param


def blocker_of(body: ChatCompletionRequest, max_tokens_limit: int) -> Blocker | None:
    """The first field of `body` the local model cannot serve, or None."""
    for name, needs in UPSTREAM_ONLY:
        if getattr(body, name) is not None:
            return Blocker(name, f"{needs} needs the upstream model")
    if body.modalities and "audio" in body.modalities:
        return Blocker("modalities", "audio output needs the upstream model")
    for i, message in enumerate(body.messages):
        if message.role in ("tool", "function"):
            return Blocker(f"messages[{i}].role", "tool results need the upstream model", kind="tool_result")
        for name in ("tool_calls", "function_call", "audio"):  # an assistant's; extra keys elsewhere
            if message.role == "assistant" and getattr(message, name):
                return Blocker(f"messages[{i}].{name}", f"a message with {name} needs the upstream model",
                               kind=f"assistant_{name}")
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, MediaPart) and part.type != "refusal":
                return Blocker(f"messages[{i}].content[{j}]", f"{part.type} parts need the upstream model",
                               kind=f"{MEDIA[part.type]}_part")
    requested = body.requested_max_tokens
    if requested is not None and requested > max_tokens_limit:
        name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return Blocker(name, f"more than the local model's limit of {max_tokens_limit} tokens needs the upstream model")
    return None


@dataclass
class Passing:
    """A request admitted for pass-through, holding its budget reservation until it is settled."""

    id: str
    created: int
    tenant: Tenant
    body: ChatCompletionRequest
    blocker: Blocker
    upstream: Upstream
    gate: HandoffGate
    reservation: Reservation
    params: dict[str, Any]  # what the upstream is sent (see `upstream_params`)
    prompt_tokens: int  # the prompt as counted at admission: what a call without usage is billed
    routing: dict[str, Any] = field(default_factory=dict)  # usage.routing, once the call is settled
    released: bool = False  # its parallel slot, once

    async def complete(self) -> dict[str, Any]:
        """The answer as an OpenAI chat.completion body; settles the reservation."""
        response = await self._call(stream=False)
        body = response.model_dump()
        await self._settle(response, _answer_text(body))
        return self._rename(body, "chat.completion") | {"usage": self.usage()}

    async def open_stream(self) -> AsyncIterator[dict[str, Any]]:
        """Start the upstream's stream (so that a refusal is still an HTTP error) and return the
        answer as chat.completion.chunk bodies; see `_chunks`."""
        return self._chunks(await self._call(stream=True))

    async def _chunks(self, stream: Any) -> AsyncIterator[dict[str, Any]]:
        """The upstream's chunks renamed (the usage chunk only if the client asked for it); settles
        the reservation when the stream ends, however it ends."""
        usage_seen, text = None, []
        try:
            async for chunk in stream:
                body = chunk.model_dump()
                if body.get("usage"):
                    usage_seen = chunk
                for choice in body.get("choices") or ():
                    text.append(_written(choice.get("delta") or {}))
                body.pop("usage", None)
                if body.get("choices"):
                    yield self._rename(body, "chat.completion.chunk")
        finally:  # also when the client left or the stream broke: bill what was written
            # One shielded step: a cancelled stream may not await anything else after it.
            await asyncio.shield(self._end_stream(stream, usage_seen, "".join(text)))
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield self._rename({"choices": [], "usage": self.usage()}, "chat.completion.chunk")

    async def _end_stream(self, stream: Any, usage_seen: Any, text: str) -> None:
        """Close the upstream's stream (ending its answer and giving back its cache lease), then settle."""
        try:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        finally:
            await self._settle(usage_seen, text)

    async def release(self, runtime: Runtime) -> None:
        """Give back the request's parallel slot, once."""
        if not self.released:
            self.released = True
            await release(runtime, self.tenant, self.id)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object, as billed by the upstream (known once the call is settled)."""
        prompt, completion = self.routing["upstream_prompt_tokens"], self.routing["upstream_completion_tokens"]
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "routing": self.routing}

    def header(self) -> str:
        return f"mode=passthrough; reason={self.blocker.param}; calls=1"

    async def _call(self, stream: bool) -> Any:
        params = self.params
        if stream:
            params = {**params, "stream": True, "stream_options": {"include_usage": True}}
        call = asyncio.ensure_future(self.upstream.whole.chat(params, self.gate.cache_scope))
        try:
            return await asyncio.shield(call)  # a client that leaves leaves the call running, to be billed
        except UpstreamRejected as exc:
            await asyncio.shield(self.gate.release(self.reservation))
            raise InvalidRequest(f"the upstream refused the request: {exc}", param=self.blocker.param) from exc
        except UpstreamBusy as exc:
            await asyncio.shield(self.gate.release(self.reservation))
            raise Overloaded(f"the upstream model is busy ({exc}); retry shortly") from exc
        except UpstreamUnavailable as exc:
            await asyncio.shield(self.gate.release(self.reservation))
            error = GatewayError(f"the upstream model is unavailable ({exc}); retry shortly")
            error.status, error.code = 502, "upstream_unavailable"
            raise error from exc
        except BaseException:
            self.gate.finish_in_background(self.reservation, call, self._settle_unread)
            raise

    async def _settle_unread(self, response: Any) -> None:
        """Settle a call whose client left before reading it: a whole answer as it reports, a stream
        (closed unread) for its prompt."""
        if hasattr(response, "__aiter__"):
            await self._end_stream(response, None, "")
        else:
            await self._settle(response, _answer_text(response.model_dump()))

    async def _settle(self, response: Any, text: str) -> None:
        """Bill what the upstream reported; without its usage (a stream cut short), the prompt as
        counted at admission and the tokens of what it wrote. Once."""
        if self.routing:
            return
        usage = self.upstream.billed_usage(response)
        prompt = usage.prompt_tokens or self.prompt_tokens
        completion = usage.completion_tokens
        if completion is None:
            completion = self.upstream.whole.count_text_tokens(text)
        cached = usage.cached_tokens
        cost = self.upstream.estimate_cost(prompt, completion, cached)
        self.routing = {
            "mode": "passthrough", "passthrough_reason": self.blocker.param, "local_tokens": 0,
            "upstream_tokens": completion, "upstream_calls": 1, "upstream_prompt_tokens": prompt,
            "upstream_completion_tokens": completion, "upstream_cached_tokens": cached,
            "upstream_cost_usd": round(cost, 8), "degraded": [],
        }
        await self.gate.settle(self.reservation, Billed(prompt, completion, cost, cached, 0.0))

    def _rename(self, body: dict[str, Any], kind: str) -> dict[str, Any]:
        """The upstream's body under this request's id, time and model name."""
        return {**body, "id": self.id, "object": kind, "created": self.created, "model": self.body.model}


def _answer_text(body: dict[str, Any]) -> str:
    return "".join(_written(c.get("message") or {}) for c in body.get("choices") or ())


def _written(message: dict[str, Any]) -> str:
    """What a message (or a streamed delta) wrote: its content and its tool calls' arguments,
    counted when the upstream reports no usage."""
    calls = message.get("tool_calls") or ()
    return (message.get("content") or "") + "".join(((c.get("function") or {}).get("arguments") or "") for c in calls)


async def admit(runtime: Runtime, tenant: Tenant, alias: Alias, body: ChatCompletionRequest,
                blocker: Blocker) -> Passing:
    """Refuse `body` (400 naming `blocker.param`) or reserve budget for passing it through whole."""
    refusal = _refusal(alias, tenant)
    if refusal:
        raise InvalidRequest(f"'{blocker.param}': {blocker.why}; {refusal}", param=blocker.param)
    upstream = alias.upstream
    check_media(body, upstream)
    check_tools(body, upstream.settings.tool_types, runtime.settings.server)
    if not upstream.available:
        raise Overloaded(f"'{blocker.param}' needs the upstream model, which is unavailable; retry shortly",
                         retry_after_s=upstream.settings.breaker_cooldown_s)
    max_tokens = body.requested_max_tokens or runtime.settings.server.max_tokens_limit
    params = upstream_params(body, upstream, max_tokens)
    answers = max_tokens * body.n
    gate = HandoffGate(runtime.ledger, tenant.id, tenant.limits, allowed=True, cache_scope=tenant.cache_scope)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    await admit_rates(runtime, tenant, gate, request_id)  # before the prompt is counted
    reservation = None
    try:
        prompt = await upstream.whole.count_chat_tokens(params) or await asyncio.to_thread(
            upstream.whole.estimate_chat_tokens, params["messages"], params.get("tools"))
        await admit_tokens(runtime, tenant, request_id, prompt + answers)
        if gate.allowed:
            reservation = await gate.reserve(prompt + answers, upstream.estimate_cost(prompt, answers),
                                             ttl_s=upstream.settings.passthrough_timeout_s + RESERVATION_MARGIN_S)
    except BaseException:  # the request ended before its reservation: give the slot back
        await asyncio.shield(release(runtime, tenant, request_id))
        raise
    if reservation is None:
        await release(runtime, tenant, request_id)
        if gate.refusal == "store_unavailable":
            error = GatewayError("the usage ledger is unreachable, so upstream spending cannot be checked; retry shortly")
            error.status, error.code = 503, "store_unavailable"
            raise error
        raise QuotaExceeded(f"'{blocker.param}' needs the upstream model, and this tenant's upstream budget "
                            "does not cover the request")
    return Passing(request_id, int(time.time()), tenant, body, blocker, upstream, gate, reservation, params, prompt)


def upstream_params(body: ChatCompletionRequest, upstream: Upstream, max_tokens: int) -> dict[str, Any]:
    """The client's own fields for the upstream (the gateway's extensions left out), with the
    text of messages and tools neutralized as on the token path (control-token strings a client
    typed reach the upstream as text, never as turns of its template) and the messages in shapes
    the upstream's parser accepts (adapters.message_shapes)."""
    params = body.model_dump(exclude_unset=True, by_alias=True, exclude=GATEWAY_FIELDS)
    if body.max_completion_tokens is None:
        params["max_tokens"] = max_tokens
    params["messages"] = for_upstream([_neutral_message(m, upstream.neutral) for m in params["messages"]],
                                      upstream.settings.kind)
    for name in ("tools", "functions"):
        if name in params:
            params[name] = _neutral_values(params[name], upstream.neutral)
    return params


def _neutral_message(message: dict[str, Any], neutral: Callable[[str], str]) -> dict[str, Any]:
    """A message with its content (text and text parts) and its tool calls' arguments neutralized."""
    message = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = neutral(content)
    elif isinstance(content, list):
        message["content"] = [{**p, "text": neutral(p["text"])} if p.get("type") == "text" else p for p in content]
    if message.get("tool_calls"):
        message["tool_calls"] = [_neutral_values(call, neutral) for call in message["tool_calls"]]
    return message


def _neutral_values(value: Any, neutral: Callable[[str], str]) -> Any:
    """`value` with every string in it (not its keys) neutralized."""
    if isinstance(value, str):
        return neutral(value)
    if isinstance(value, list):
        return [_neutral_values(item, neutral) for item in value]
    if isinstance(value, dict):
        return {key: _neutral_values(item, neutral) for key, item in value.items()}
    return value


def check_media(body: ChatCompletionRequest, upstream: Upstream) -> None:
    """Refuse (400) a part in any message of a medium the upstream does not read (not only the
    part that sent the request to it: a request with tools may carry an image further on)."""
    for i, message in enumerate(body.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            medium = MEDIA.get(part.type) if isinstance(part, MediaPart) else None
            if medium and not upstream.whole.reads(medium):
                raise InvalidRequest(f"'messages[{i}].content[{j}]': {part.type} parts need the upstream model, and "
                                     f"this model's upstream does not read {medium} input",
                                     param=f"messages[{i}].content[{j}]")


def check_tools(body: ChatCompletionRequest, tool_types: list[str], server: ServerSettings) -> None:
    """Refuse (400) a tool of a type the upstream is not configured for (litellm would handle it
    itself: MCP servers, web search), and a definition nested or sized past the server's limits
    (an upstream compiles each schema, and a deep one held one for tens of seconds). Tool calls in
    the conversation must be of a served type too (an upstream parses them to render its template)."""
    for i, message in enumerate(body.messages):
        for j, call in enumerate(getattr(message, "tool_calls", None) or ()):
            if call.type not in tool_types:
                raise InvalidRequest(f"tool calls of type '{call.type}' are not served here (served: "
                                     f"{', '.join(tool_types)})", param=f"messages[{i}].tool_calls[{j}].type")
    for name, tools in (("tools", body.tools or ()), ("functions", body.functions or ())):
        for i, tool in enumerate(tools):
            kind = tool.get("type", "function") if name == "tools" else "function"
            if kind not in tool_types:
                raise InvalidRequest(f"tools of type '{quoted(str(kind))}' are not served here (served: "
                                     f"{', '.join(tool_types)})", param=f"{name}[{i}].type")
            if kind == "function":
                _check_named(tool.get("function") if name == "tools" else tool, f"{name}[{i}]" + (
                    ".function" if name == "tools" else ""))
            if depth_of(tool) > server.max_tool_schema_depth:
                raise InvalidRequest(f"'{name}[{i}]' is nested deeper than {server.max_tool_schema_depth} levels",
                                     param=f"{name}[{i}]")
            if len(json.dumps(tool)) > server.max_tool_schema_bytes:
                raise InvalidRequest(f"'{name}[{i}]' is larger than {server.max_tool_schema_bytes} bytes of JSON",
                                     param=f"{name}[{i}]")


def _check_named(function: Any, where: str) -> None:
    """A function definition must name its function: llama-server answers one without a name with a
    500, which reads as an outage (a 502 to the client, and a failure against the breaker)."""
    if not isinstance(function, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequest(f"Missing required parameter: '{where}.name'.", param=f"{where}.name")


def _refusal(alias: Alias, tenant: Tenant) -> str | None:
    """Why this alias and tenant may not pass a request through, or None."""
    unsupported = tenant.settings.unsupported or alias.settings.unsupported
    if unsupported == "refuse":
        return "this model is configured to refuse such requests rather than pass them to its upstream"
    if alias.upstream is None:
        return "this model has no upstream model"
    if not tenant.settings.allow_upstream:
        return "this API key may not send requests to the upstream model"
    return None
