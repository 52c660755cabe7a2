"""The litellm upstream adapter: a real server process, failures, the circuit breaker, echo stripping."""

from __future__ import annotations

import dataclasses
import time

import pytest

from adapters.upstream import CircuitBreaker, UpstreamUnavailable, strip_echo
from gateway.runtime import make_upstream
from gateway.settings import UpstreamSettings
from tests.conftest import SMOL, free_port

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def settings(api_base: str, **extra) -> UpstreamSettings:
    values = dict(model="text-completion-openai/up", api_base=api_base, mode="completions", template_gguf=SMOL,
                  extra_body={"repeat_penalty": 1.0}, timeout_s=5, retries=1, breaker_failures=2,
                  breaker_cooldown_s=0.5, input_usd_per_mtok=2.0, output_usd_per_mtok=6.0)
    values.update(extra)
    return UpstreamSettings(**values)


@pytest.mark.integration
async def test_real_server_continues_and_bills(smol_upstream):
    upstream = make_upstream("up", settings(smol_upstream))
    handoff = dataclasses.replace(upstream.handoff(QUESTION), answer="The capital")
    result = await upstream.continue_text(handoff, max_tokens=3, temperature=0.0, top_p=1.0, seed=None)
    assert result.text and not result.text.startswith("The capital")
    assert result.completion_tokens == 3
    # the estimate uses the upstream's own tokenizer, so it is what the server bills
    assert result.prompt_tokens == upstream.estimate_prompt_tokens(handoff) > 20
    assert result.cost_usd == pytest.approx((result.prompt_tokens * 2.0 + 3 * 6.0) / 1e6)
    assert result.latency_s > 0


@pytest.mark.integration
async def test_dead_upstream_fails_fast_and_opens_the_breaker():
    upstream = make_upstream("dead", settings(f"http://127.0.0.1:{free_port()}/v1"))
    handoff = upstream.handoff(QUESTION)
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable):
        await upstream.continue_text(handoff, 1, 0.0, 1.0, None)  # two attempts: the breaker opens
    assert not upstream.available
    with pytest.raises(UpstreamUnavailable, match="circuit breaker open"):
        await upstream.continue_text(handoff, 1, 0.0, 1.0, None)
    assert time.monotonic() - started < 5
    time.sleep(0.6)
    assert upstream.available  # one trial call is allowed after the cool-down


def test_breaker_closes_on_success():
    breaker = CircuitBreaker(failures=2, cooldown_s=10)
    breaker.record(False, 0.0)
    breaker.record(True, 1.0)
    breaker.record(False, 2.0)
    assert breaker.allows(2.0)  # failures must be consecutive
    breaker.record(False, 3.0)
    assert not breaker.allows(5.0) and breaker.allows(13.0)


@pytest.mark.parametrize(
    ("answer", "text", "expected"),
    [
        ("The capital of", "The capital of France is", " France is"),
        ("The capital of", "capital of France", " France"),
        ("The capital of", " France", " France"),
        ("abc", "abcabc", "abc"),
    ],
)
def test_strip_echo(answer, text, expected):
    assert strip_echo(answer, text) == expected
