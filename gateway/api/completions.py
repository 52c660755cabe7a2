"""POST /v1/completions: OpenAI's legacy text completions on the token-level path. Each prompt is
continued as plain text (no chat template; control-token strings in it stay text), `n` choices of
each, with routing, `echo`, `stop`, `logprobs` and streaming as OpenAI has them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway import observability
from gateway.admission.chat import Admitted, Prompts, alias_for, start
from gateway.api.chat_bodies import usage_of
from gateway.api.chat_completions import event_stream, parse_body, shadow_task, sse_stream
from gateway.api.routes import authenticate, runtime_of
from gateway.api.started import Decoded
from gateway.decoding.decoder import Piece, TokenLogprob
from gateway.runtime import Alias
from gateway.wire.errors import InvalidRequest
from gateway.wire.schemas import CompletionRequest

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    runtime = runtime_of(request)
    tenant = authenticate(request)
    body = await parse_body(request, CompletionRequest)
    observability.note_model(body.model)
    body.check(runtime.settings.server.max_tokens_limit)
    alias = alias_for(runtime, tenant, body.model)
    texts = tuple(prompt_text(alias, prompt, i) for i, prompt in enumerate(body.prompts_raw))
    admitted = await start(runtime, tenant, alias, body, Prompts(texts=texts))
    answer = Decoded(admitted)
    if body.stream:
        return event_stream(runtime, answer, sse_stream(runtime, answer, _chunks(admitted, texts)))
    pieces = await answer.collected(request)
    choices = [_choice(admitted, i, texts, chosen, decoding.finish_reason)
               for i, (decoding, chosen) in enumerate(zip(admitted.decodings, pieces))]
    return JSONResponse(_body(admitted, choices, usage_of(admitted)), headers=answer.headers(),
                        background=shadow_task(runtime, answer))


def prompt_text(alias: Alias, prompt: str | list[int], index: int) -> str:
    """A prompt as text; token ids are the local model's."""
    if isinstance(prompt, str):
        return prompt
    if not prompt or any(not 0 <= token < alias.local.n_vocab for token in prompt):
        raise InvalidRequest(f"prompt {index} must hold token ids of the local model's vocabulary of "
                             f"{alias.local.n_vocab}", param="prompt")
    return b"".join(alias.local.token_bytes(token) for token in prompt).decode("utf-8", "replace")


def _choice(admitted: Admitted, index: int, texts: tuple[str, ...], pieces: list[Piece],
            finish_reason: str | None, offset: int | None = None) -> dict[str, Any]:
    """One choice's `text` (the prompt first with `echo`, unless `offset` says how much of the
    choice's text came before: a later chunk), logprobs and finish reason."""
    body = admitted.body
    text = "".join(p.text for p in pieces)
    if offset is None:
        offset = 0
        if body.echo:
            text = texts[index // body.n] + text
            offset = len(texts[index // body.n])
    logprobs = None
    if body.logprobs is not None:
        logprobs = _logprobs([e for p in pieces for e in p.logprobs], offset)
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def _logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy logprobs object: tokens, their logprobs, the top alternatives, text offsets."""
    tokens = [e.text.decode("utf-8", "replace") for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text.decode("utf-8", "replace"): lp for _, text, lp in e.top} for e in entries],
            "text_offset": offsets}


def _body(admitted: Admitted, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": admitted.id, "object": "text_completion", "created": admitted.created,
                            "model": admitted.body.model, "choices": choices, "system_fingerprint": None}
    if usage is not None:
        body["usage"] = usage
    return body


async def _chunks(admitted: Admitted, texts: tuple[str, ...]) -> AsyncIterator[dict[str, Any]]:
    """One chunk per piece of each choice (the echoed prompt with its first), one with each
    choice's finish_reason, then usage if asked for."""
    written: dict[int, int] = {}  # characters of each choice sent so far (its echoed prompt included)
    async for index, piece in observability.metered(admitted):
        if piece.text or piece.logprobs:
            choice = _choice(admitted, index, texts, [piece], None, written.get(index))
            written[index] = written.get(index, 0) + len(choice["text"])
            yield _body(admitted, [choice], None)
    for index, decoding in enumerate(admitted.decodings):
        yield _body(admitted, [_choice(admitted, index, texts, [], decoding.finish_reason, written.get(index))], None)
    options = admitted.body.stream_options
    if options is not None and options.include_usage:
        yield _body(admitted, [], usage_of(admitted))
