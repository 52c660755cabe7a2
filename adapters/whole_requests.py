"""Requests passed through whole to an upstream (tools, images, what the local model cannot serve):
one chat call per request, on the same server, circuit breaker and tenant cache isolation as
the upstream's hand-offs, and the upstream's own count of the rendered prompt where it gives one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import httpx
import openai

from adapters.cache_isolation import Isolation
from adapters.litellm_client import litellm
from adapters.trace_context import trace_params
from adapters.upstream_errors import (
    CircuitBreaker,
    UpstreamFailedRequest,
    UpstreamRejected,
    UpstreamUnavailable,
    failure_of,
    upstream_message,
)
from adapters.upstream_server import server_root
from adapters.upstream_settings import UpstreamSettings, api_key_of
from adapters.vocabulary import Vocabulary


class WholeRequests:
    """Whole chat requests to one upstream. Safe to share across requests."""

    def __init__(self, name: str, settings: UpstreamSettings, vocab: Vocabulary | None, breaker: CircuitBreaker,
                 isolation: Isolation) -> None:
        self.name, self._settings, self._vocab = name, settings, vocab
        self._breaker, self._isolation = breaker, isolation

    @property
    def chat_model(self) -> str:
        """litellm model name for whole chat requests: `chat_model`, else `model` with a text
        completion provider read as its chat one (text-completion-openai/x -> openai/x)."""
        provider, _, name = self._settings.model.partition("/")
        if self._settings.chat_model:
            return self._settings.chat_model
        return f"openai/{name}" if provider == "text-completion-openai" else self._settings.model

    def reads(self, medium: str) -> bool:
        """Does this upstream read `medium` (image, audio or file) in messages? (`inputs`, else litellm's map.)"""
        if self._settings.inputs is not None:
            return medium in self._settings.inputs
        check = {"image": litellm().supports_vision, "audio": litellm().supports_audio_input,
                 "file": litellm().supports_pdf_input}[medium]
        try:
            return bool(check(model=self.chat_model))
        except Exception:  # noqa: BLE001 - litellm raises bare Exception for unmapped models
            return False

    async def count_chat_tokens(self, params: dict[str, Any]) -> int | None:
        """The upstream's own count of the prompt of a whole chat request (its template and tool
        preamble included), where it can give one: llama-server renders it (/apply-template) and
        counts it (/tokenize). None elsewhere, or when the server does not answer."""
        if self._settings.kind != "llama-server" or not self._settings.api_base:
            return None
        root = server_root(self._settings.api_base)
        body = {k: params[k] for k in ("messages", "tools", "tool_choice", "parallel_tool_calls") if k in params}
        try:
            async with httpx.AsyncClient(timeout=self._settings.timeout_s) as client:
                rendered = (await client.post(f"{root}/apply-template", json=body)).raise_for_status().json()
                counted = await client.post(f"{root}/tokenize", json={
                    "content": rendered["prompt"], "add_special": True, "parse_special": True})
                return len(counted.raise_for_status().json()["tokens"])
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return None

    def count_text_tokens(self, text: str) -> int:
        """Tokens of `text` in the upstream's vocabulary where it is known, else tiktoken's count."""
        if self._vocab is not None:
            return self._vocab.count(text)
        return litellm().token_counter(model="gpt-4o", text=text)

    def estimate_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        """Billed prompt tokens of a whole chat request, over-estimated (tiktoken, plus 25%) so that a
        reservation rarely falls short: the upstream's template and tool rendering add their own."""
        try:
            counted = litellm().token_counter(model="gpt-4o", messages=messages, tools=tools)
        except Exception:  # noqa: BLE001 - shapes its counter does not know (new part types): count the JSON
            counted = litellm().token_counter(model="gpt-4o", text=json.dumps([messages, tools], default=str))
        return int(counted * 1.25) + 16

    async def chat(self, params: dict[str, Any], scope: str = "shared") -> Any:
        """Send one whole chat request (the client's fields in `params`, `stream` included) in cache
        `scope`, and return litellm's response, or its chunk stream once the upstream has started
        answering (an async iterator that holds the call's cache lease until it ends or is closed).

        One attempt (the client retries, as it would with the provider). The whole body is the
        client's, so a 5xx may be of its own making: it raises UpstreamFailedRequest and holds
        nothing against the upstream; a transport error, time-out, 408 or 429 counts against the
        circuit breaker and raises UpstreamUnavailable; a refusal (4xx) raises UpstreamRejected
        with the upstream's own words (adapters.upstream_errors.failure_of, upstream_message)."""
        trial = self._breaker.acquire(time.monotonic())
        if trial is None:
            raise UpstreamUnavailable(f"circuit breaker open for upstream '{self.name}'")
        s = self._settings
        params = dict(params)
        # The client's metadata is OpenAI's string map for the provider, never litellm's own metadata.
        extra_body = {"metadata": params.pop("metadata")} if "metadata" in params else {}
        lease = contextlib.AsyncExitStack()
        try:
            extra_body.update(await lease.enter_async_context(self._isolation.lease(scope, uuid.uuid4().hex, long=True)))
            # allowed_openai_params: litellm would refuse fields it does not map for this provider
            # (verbosity, prompt_cache_key, ...); the client sent them for the upstream to judge.
            response = await litellm().acompletion(
                model=self.chat_model, api_base=s.api_base, api_key=api_key_of(s), timeout=s.passthrough_timeout_s,
                num_retries=0, allowed_openai_params=[name for name in params if name != "messages"],
                extra_body=extra_body, **trace_params(), **params)
        except (openai.OpenAIError, httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
            await lease.aclose()
            # llama-server answers 500 to messages it cannot parse, and to numbers past its parser
            failure = failure_of(exc, client_values=True)
            self._breaker.record_failure(failure, time.monotonic(), trial)
            if failure == "refused":
                raise UpstreamRejected(upstream_message(exc)) from exc
            failed = UpstreamFailedRequest if failure == "request" else UpstreamUnavailable
            raise failed(f"upstream '{self.name}' failed: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            await lease.aclose()
            self._breaker.abandon(trial)
            raise
        self._breaker.record(True, time.monotonic(), trial)
        if not params.get("stream"):
            await lease.aclose()
            return response
        return _leased(response, lease)


async def _leased(stream: Any, lease: contextlib.AsyncExitStack) -> Any:
    """A streamed answer that, when it ends or is closed, closes the upstream's stream (so the
    upstream stops writing) and gives its cache lease back."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        try:
            if hasattr(stream, "aclose"):
                await stream.aclose()
        finally:
            await lease.aclose()
