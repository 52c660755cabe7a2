"""Answering a request passed through whole to the upstream: one chat call (or stream), reserved at
admission (gateway/admission/passthrough.py) and settled to what the upstream billed, also when the
client leaves; the answer keeps the upstream's shapes under the gateway's id and model name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from adapters.store import Billed, Reservation
from adapters.upstream import Upstream, UpstreamRejected, UpstreamUnavailable
from adapters.upstream_errors import UpstreamBusy, status_of
from gateway.decoding.handoffs import Gate
from gateway.traced import traced
from gateway.wire.errors import GatewayError, InvalidRequest, Overloaded
from gateway.wire.schemas import ChatCompletionRequest

log = logging.getLogger("gateway.decoding.passing")


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



@dataclass
class Passing:
    """A request admitted for pass-through, holding its budget reservation until it is settled."""

    id: str
    created: int
    tenant_id: str
    body: ChatCompletionRequest
    blocker: Blocker
    upstream: Upstream
    gate: Gate
    reservation: Reservation
    params: dict[str, Any]  # what the upstream is sent (see `upstream_params`)
    prompt_tokens: int  # the prompt as counted at admission: what a call without usage is billed
    give_back_slot: Callable[[], Awaitable[None]]  # the tenant's parallel slot (admission's)
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

    async def release(self) -> None:
        """Give back the request's parallel slot, once."""
        if not self.released:
            self.released = True
            await self.give_back_slot()

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object, as billed by the upstream (known once the call is settled)."""
        prompt, completion = self.routing["upstream_prompt_tokens"], self.routing["upstream_completion_tokens"]
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "routing": self.routing}

    def header(self) -> str:
        return f"mode=passthrough; reason={self.blocker.param}; calls=1"

    @traced("gateway.passthrough")
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
            raise self._unavailable(exc) from exc
        except BaseException:
            self.gate.finish_in_background(self.reservation, call, self._settle_unread)
            raise

    def _unavailable(self, exc: UpstreamUnavailable) -> GatewayError:
        """The 502 of a call the upstream failed: a fixed sentence and the status it answered, never
        the exception's text (litellm's class names, the upstream's key, the client's own values).
        The log names the exception, but keeps no upstream's words: they may quote the prompt."""
        cause = exc.__cause__
        status = None if cause is None else status_of(cause)
        if cause is None:  # the gateway's own words (an open breaker)
            log.warning("pass-through %s failed: %s", self.id, exc)
        else:
            log.warning("pass-through %s failed: %s (HTTP %s)", self.id, type(cause).__name__, status)
        answered = f" (it answered HTTP {status})" if status is not None else ""
        error = GatewayError(f"the upstream model is unavailable{answered}; retry shortly")
        error.status, error.code = 502, "upstream_unavailable"
        return error

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
