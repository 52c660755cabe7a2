"""A started request as the routes answer it, behind one protocol: decoded on the token-level path
(`Decoded`) or passed through whole to the upstream (`PassedThrough`). `answer_of` is the one
place that asks which; the routes only ask the answer for its body, chunks, headers and ending."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request

from gateway import observability
from gateway.admission.chat import Admitted
from gateway.api.chat_bodies import chunk, completion_body, routing_header, usage_chunk
from gateway.decoding.decoder import Piece
from gateway.decoding.passing import Passing
from gateway.shadow.cases import ShadowCase, case_of
from gateway.wire.errors import ClientClosedRequest


class StartedAnswer(Protocol):
    """What every route needs of a started request, however it is served."""

    id: str
    failure: str  # the error event's words when the stream fails after it started

    def headers(self) -> dict[str, str]:
        """The response's headers (`x-routing-summary` where it is known before the body)."""

    async def whole(self, request: Request) -> dict[str, Any]:
        """The chat.completion body; `finish` has run when it returns or raises. A client that
        leaves first stops the work (no more decoding or upstream spending)."""

    async def open_chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The answer as chat.completion.chunk bodies; whatever refuses it is raised here, before
        any event is sent. The caller runs `finish` once the chunks end."""

    async def release(self) -> None:
        """Give back the request's parallel slot (once; safe to repeat)."""

    async def finish(self) -> None:
        """Release the slot and count the request; once per request."""

    def shadow_case(self) -> ShadowCase | None:
        """What a shadow answer compares, for an answer decoded here; None otherwise."""


def answer_of(started: Admitted | Passing) -> StartedAnswer:
    return Decoded(started) if isinstance(started, Admitted) else PassedThrough(started)


@dataclass
class Decoded:
    """A request decoded on the token-level path (one Decoding per choice)."""

    admitted: Admitted
    failure: str = "internal error while decoding; the gateway logged the details"

    @property
    def id(self) -> str:
        return self.admitted.id

    def headers(self) -> dict[str, str]:
        # a stream's summary is known only at its end (its usage chunk carries it)
        return {} if self.admitted.body.stream else {"x-routing-summary": routing_header(self.admitted)}

    async def whole(self, request: Request) -> dict[str, Any]:
        return completion_body(self.admitted, await self.collected(request))

    async def collected(self, request: Request) -> list[list[Piece]]:
        """Each choice's pieces; `finish` runs however it ends."""
        try:
            return await unless_client_leaves(request, self._collect())
        finally:
            await asyncio.shield(self.finish())

    async def open_chunks(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks()

    async def release(self) -> None:
        await self.admitted.release()

    async def finish(self) -> None:
        await self.admitted.release()

    def shadow_case(self) -> ShadowCase | None:
        return case_of(self.admitted)

    async def _collect(self) -> list[list[Piece]]:
        pieces: list[list[Piece]] = [[] for _ in self.admitted.decodings]
        async for index, piece in observability.metered(self.admitted):
            pieces[index].append(piece)
        return pieces

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Per choice the role, one delta per piece (finish_reason on the last), then usage."""
        admitted = self.admitted
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


@dataclass
class PassedThrough:
    """A request only the upstream can serve, passed through whole (gateway/decoding/passing.py)."""

    passing: Passing
    failure: str = "the upstream's stream failed; the gateway logged the details"

    @property
    def id(self) -> str:
        return self.passing.id

    def headers(self) -> dict[str, str]:
        return {"x-routing-summary": self.passing.header()}

    async def whole(self, request: Request) -> dict[str, Any]:
        try:
            return await unless_client_leaves(request, self.passing.complete())
        finally:
            await asyncio.shield(self.finish())

    async def open_chunks(self) -> AsyncIterator[dict[str, Any]]:
        try:
            return await self.passing.open_stream()  # the upstream call starts here
        except BaseException:
            await asyncio.shield(self.passing.release())
            raise

    async def release(self) -> None:
        await self.passing.release()

    async def finish(self) -> None:
        await self.passing.release()
        observability.count_passthrough(self.passing)

    def shadow_case(self) -> ShadowCase | None:
        return None


async def unless_client_leaves(request: Request, work: Awaitable[Any]) -> Any:
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
