"""SSE framing when decoding fails after the stream started: one error event, no [DONE]."""

from __future__ import annotations

import json
from types import SimpleNamespace

from gateway.admission.chat import Admitted
from gateway.api.chat_completions import _stream
from gateway.api.errors import GatewayError
from gateway.api.schemas import ChatCompletionRequest
from gateway.decoding.decoder import Piece


class BrokenDecoding:
    """Yields one piece, then fails the way a crashed local model would."""

    finish_reason = None

    async def pieces(self):
        yield Piece("Hello", (1,), "local", None)
        raise RuntimeError("llama.cpp exploded")


async def test_error_after_the_stream_started_is_one_error_event():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    admitted = Admitted("chatcmpl-x", 0, None, None, body, [BrokenDecoding()], released=True)  # holds no slot
    events = [event["data"] async for event in _stream(SimpleNamespace(), admitted)]
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
    admitted = Admitted("chatcmpl-y", 0, None, None, body, [Refusing()], released=True)
    events = [event["data"] async for event in _stream(SimpleNamespace(), admitted)]
    assert json.loads(events[-1])["error"]["message"] == "the local model stopped"
