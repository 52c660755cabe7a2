"""SSE framing when decoding fails after the stream started: one error event (no [DONE] in chat
completions; an `error` event and no response.completed in the Responses API)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from gateway.admission.chat import Admitted
from gateway.api.chat_completions import sse_stream
from gateway.api.started import Decoded
from gateway.api.responses_api import _events
from gateway.decoding.decoder import Piece
from gateway.responses.output import ResponseDraft
from gateway.responses.request import ResponsesRequest
from gateway.wire.errors import GatewayError
from gateway.wire.schemas import ChatCompletionRequest


class BrokenDecoding:
    """Yields one piece, then fails the way a crashed local model would."""

    finish_reason = None

    async def pieces(self):
        yield Piece("Hello", (1,), "local", None)
        raise RuntimeError("llama.cpp exploded")


NO_SHADOW = SimpleNamespace(shadow=None)  # a runtime that shadows nothing


async def sse_data(admitted: Admitted) -> list[str]:
    answer = Decoded(admitted)
    chunks = await answer.open_chunks()
    return [event["data"] async for event in sse_stream(NO_SHADOW, answer, chunks)]


async def test_error_after_the_stream_started_is_one_error_event():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    admitted = Admitted("chatcmpl-x", 0, None, None, body, [BrokenDecoding()], None, released=True)  # holds no slot
    events = await sse_data(admitted)
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    error = json.loads(events[-1])
    assert set(error) == {"error"} and error["error"]["type"] == "server_error"
    assert "exploded" not in error["error"]["message"]  # internals stay in the log
    assert "[DONE]" not in events


async def test_gateway_error_mid_stream_keeps_its_status_type():
    class Refusing(BrokenDecoding):
        async def pieces(self):
            yield Piece("Hi", (1,), "local", None)
            raise GatewayError("the local model stopped")

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    admitted = Admitted("chatcmpl-y", 0, None, None, body, [Refusing()], None, released=True)
    events = await sse_data(admitted)
    assert json.loads(events[-1])["error"]["message"] == "the local model stopped"


async def test_responses_stream_error_is_an_error_event_and_nothing_completes():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    admitted = Admitted("chatcmpl-z", 0, None, None, body, [BrokenDecoding()], None, released=True)
    draft = ResponseDraft(ResponsesRequest(model="m", input="hi", stream=True))
    answer = Decoded(admitted)
    chunks = await answer.open_chunks()
    events = [json.loads(e["data"]) async for e in _events(NO_SHADOW, None, answer, chunks, draft, [])]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "error"]  # never response.completed
    assert events[-1]["code"] is None and "exploded" not in events[-1]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
