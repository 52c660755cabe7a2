"""Which field keeps a request off the token-level path, what admitting it holds, and what a
client sees when the upstream fails it (unit: the request schema, blocker_of, admit, Passing)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from adapters.memory_store import MemoryStore
from adapters.store import RateLimits
from adapters.upstream import Upstream
from gateway.admission.passthrough import admit, blocker_of, check_media, check_tools
from gateway.decoding.passing import Passing
from gateway.settings import RateLimitSettings, ServerSettings, TenantSettings, UpstreamSettings
from gateway.tenancy.budget import Ledger
from gateway.tenancy.tenants import Tenant
from gateway.wire.errors import GatewayError, InvalidRequest
from gateway.wire.schemas import ChatCompletionRequest

USER = {"role": "user", "content": "Hi"}
NOW = 1_790_000_000.0
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **fields})


@pytest.mark.parametrize(("fields", "param", "reason"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
    ({"tool_choice": "none"}, "tool_choice", "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions", "functions"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio"),
    ({"modalities": ["text", "audio"]}, "modalities", "modalities"),
    ({"web_search_options": {}}, "web_search_options", "web_search_options"),
    ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "c1", "content": "42"}]}, "messages[1].tool_calls", "assistant_tool_calls"),
    ({"messages": [{"role": "tool", "tool_call_id": "c1", "content": "42"}]}, "messages[0].role", "tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[1]", "image_part"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages[0].content[0]", "audio_part"),
    ({"max_tokens": 65}, "max_tokens", "max_tokens"),
    ({"max_completion_tokens": 65}, "max_completion_tokens", "max_completion_tokens"),
])
def test_the_first_field_only_an_upstream_serves_is_named(fields, param, reason):
    blocker = blocker_of(request(**fields), max_tokens_limit=64)
    assert blocker is not None and (blocker.param, blocker.reason) == (param, reason)


@pytest.mark.parametrize("fields", [
    {},
    {"max_tokens": 64, "n": 2, "presence_penalty": 1.0, "frequency_penalty": -1.0, "logit_bias": {"5": -100}},
    {"response_format": {"type": "json_object"}, "user": "u", "metadata": {"k": "v"}, "store": True,
     "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s", "reasoning_effort": "low",
     "verbosity": "low", "prediction": {"type": "content", "content": "x"}, "parallel_tool_calls": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "prompt_cache_breakpoint": {}}],
                   "tool_calls": "an extra key of a user message, not a call"}]},
    {"messages": [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, USER]},
])
def test_what_the_local_model_serves_stays_local(fields):
    assert blocker_of(request(**fields), max_tokens_limit=64) is None


def test_null_means_the_documented_default():
    body = request(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None)
    assert (body.temperature, body.top_p, body.n, body.stream, body.presence_penalty) == (1.0, 1.0, 1, False, 0.0)


def test_every_media_part_is_checked_not_only_the_one_that_sent_the_request_upstream():
    body = request(tools=[{"type": "function", "function": {"name": "f"}}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Look"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]}])
    assert blocker_of(body, max_tokens_limit=64).param == "tools"
    text_only = SimpleNamespace(whole=SimpleNamespace(reads=lambda medium: False))
    with pytest.raises(InvalidRequest) as caught:
        check_media(body, text_only)
    assert caught.value.param == "messages[0].content[1]" and "does not read image" in caught.value.message
    check_media(body, SimpleNamespace(whole=SimpleNamespace(reads=lambda medium: medium == "image")))


def test_tool_calls_in_the_conversation_must_be_of_a_served_type():
    custom = {"id": "c1", "type": "custom", "custom": {"name": "sh", "input": "ls"}}
    body = request(messages=[USER, {"role": "assistant", "content": None, "tool_calls": [CALL, custom]}])
    with pytest.raises(InvalidRequest) as caught:
        check_tools(body, ["function"], ServerSettings())
    assert caught.value.param == "messages[1].tool_calls[1].type"
    check_tools(body, ["function", "custom"], ServerSettings())


class ReserveInFlight(MemoryStore):
    """A MemoryStore whose reserve never answers (the reply still in flight when the client leaves)."""

    async def reserve(self, reservation, limits, now, ttl_s=0.0):
        await asyncio.Event().wait()


async def test_a_pass_through_that_ends_before_its_reservation_gives_its_parallel_slot_back():
    store, one = ReserveInFlight(), RateLimits(max_parallel=1)
    runtime = SimpleNamespace(ledger=Ledger(store, clock=lambda: NOW), settings=SimpleNamespace(server=ServerSettings()))
    tenant = Tenant("t", TenantSettings(id="t", api_key_env="T_KEY", rate_limits=RateLimitSettings(max_parallel=1)))
    whole = SimpleNamespace(count_chat_tokens=lambda params: asyncio.sleep(0, 10), reads=lambda medium: False)
    upstream = SimpleNamespace(available=True, whole=whole, neutral=str, estimate_cost=lambda prompt, answers: 0.0,
                               settings=SimpleNamespace(kind="openai", tool_types=["function"], passthrough_timeout_s=60))
    alias = SimpleNamespace(upstream=upstream, settings=SimpleNamespace(unsupported=None))
    body = request(tools=[{"type": "function", "function": {"name": "f"}}])
    admitting = asyncio.ensure_future(admit(runtime, tenant, alias, body, blocker_of(body, max_tokens_limit=64)))
    await asyncio.sleep(0.01)
    assert await store.admit("t", "r2", one, 0, NOW) is not None  # refused: the pass-through holds the one slot
    admitting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await admitting
    assert await store.admit("t", "r2", one, 0, NOW) is None


class FailingLitellm:
    """Stands for the litellm module: the upstream answers every whole request with `error`, and
    a litellm exception's text says what llama-server said of a seed of 10**309, the key it was
    called with included (an echo the gateway must not pass on)."""

    def __init__(self, status: int | None) -> None:
        self.status = status

    async def acompletion(self, **kwargs):
        from adapters.litellm_client import litellm

        said = f"number overflow at seed={kwargs['seed']} (api_key={kwargs['api_key']})"
        if self.status is None:
            raise httpx.ConnectError(said)
        kind = litellm().InternalServerError if self.status == 500 else litellm().ServiceUnavailableError
        raise kind(message=f"OpenAIException - {said}", llm_provider="openai", model="x")


def passing(monkeypatch, status: int | None, seed: int) -> Passing:
    import adapters.whole_requests

    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream-secret")
    monkeypatch.setattr(adapters.whole_requests, "litellm", lambda: FailingLitellm(status))
    upstream = Upstream("internal-upstream-key", UpstreamSettings(
        model="openai/x", mode="chat_fallback", api_key_env="UPSTREAM_KEY", breaker_failures=1), None)

    async def nothing(*args) -> None:
        return None

    body = request(tools=[{"type": "function", "function": {"name": "f"}}], seed=seed)
    gate = SimpleNamespace(cache_scope="tenant:t", release=nothing)
    return Passing("chatcmpl-1", 0, "t", body, blocker_of(body, 64), upstream, gate, None,
                   {"messages": [USER], "seed": seed, "tools": body.tools}, 10, give_back_slot=nothing)


@pytest.mark.parametrize("status", [500, 503])
async def test_a_5xx_to_a_pass_through_is_a_short_502_and_opens_nothing(monkeypatch, caplog, status):
    seed = 2**63 - 1
    call = passing(monkeypatch, status, seed)
    for _ in range(3):
        with pytest.raises(GatewayError) as failed:
            await call.complete()
    error = failed.value.body()["error"]
    assert (failed.value.status, error["code"]) == (502, "upstream_unavailable")
    assert error["message"] == f"the upstream model is unavailable (it answered HTTP {status}); retry shortly"
    for leaked in ("litellm", "Error", "Exception", "internal-upstream-key", "sk-upstream-secret", str(seed)):
        assert leaked not in error["message"]
    assert "sk-upstream-secret" not in caplog.text and f"HTTP {status}" in caplog.text
    assert call.upstream.available  # the client's own body may have caused it: other tenants still pass


async def test_an_unreachable_upstream_still_opens_the_breaker_for_pass_through(monkeypatch):
    call = passing(monkeypatch, None, 7)
    with pytest.raises(GatewayError) as failed:
        await call.complete()
    assert failed.value.message == "the upstream model is unavailable; retry shortly"
    assert not call.upstream.available
