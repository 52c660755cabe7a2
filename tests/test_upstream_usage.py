"""Billed counts from each provider's usage shape, as the providers document their response bodies."""

from __future__ import annotations

import pytest

from adapters.upstream_usage import read_usage

# OpenAI chat completion (platform docs, "Prompt caching"): cached tokens in prompt_tokens_details.
OPENAI = {"usage": {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
                    "prompt_tokens_details": {"cached_tokens": 1920},
                    "completion_tokens_details": {"reasoning_tokens": 0}}}
# DeepSeek (api-docs.deepseek.com, "Context caching"): hit and miss counts beside prompt_tokens.
DEEPSEEK = {"usage": {"prompt_tokens": 1200, "completion_tokens": 40, "total_tokens": 1240,
                      "prompt_cache_hit_tokens": 1024, "prompt_cache_miss_tokens": 176}}
# Anthropic Messages API (docs, "Prompt caching"): input_tokens excludes cache reads and writes.
ANTHROPIC = {"usage": {"input_tokens": 21, "cache_creation_input_tokens": 188, "cache_read_input_tokens": 1800,
                       "output_tokens": 393}}
# llama-server /v1/completions (tools/server/server-task.cpp): OpenAI usage plus its own timings.
LLAMA_SERVER = {"usage": {"prompt_tokens": 31, "completion_tokens": 1, "total_tokens": 32,
                          "prompt_tokens_details": {"cached_tokens": 27}},
                "timings": {"cache_n": 27, "prompt_n": 4, "prompt_ms": 35.5, "predicted_n": 1, "predicted_ms": 12.25}}
# The last chunk of a stream with stream_options.include_usage: the same usage object, no choices.
STREAM_CHUNK = {"choices": [], "usage": OPENAI["usage"]}


@pytest.mark.parametrize("body, expected", [
    (OPENAI, (2006, 300, 1920, None)),
    (DEEPSEEK, (1200, 40, 1024, None)),
    (ANTHROPIC, (21 + 188 + 1800, 393, 1800, None)),
    (LLAMA_SERVER, (31, 1, 27, 47.75)),
    (STREAM_CHUNK, (2006, 300, 1920, None)),
    ({"usage": {"prompt_tokens": 10, "completion_tokens": 2}}, (10, 2, 0, None)),
    ({}, (None, None, 0, None)),
])
def test_usage_shapes(body, expected):
    usage = read_usage(body)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.compute_ms) == expected


def test_litellm_objects_are_read_like_dicts():
    from adapters.litellm_client import litellm as configured

    litellm = configured()

    response = litellm.ModelResponse(usage=litellm.Usage(
        prompt_tokens=50, completion_tokens=5, prompt_tokens_details={"cached_tokens": 32}))
    usage = read_usage(response)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (50, 5, 32)


def upstream(**settings):
    from adapters.upstream import Upstream
    from gateway.settings import UpstreamSettings

    return Upstream("up", UpstreamSettings(mode="chat_prefix", **settings), None)


def test_cached_tokens_cost_the_configured_cached_price():
    priced = upstream(model="openai/x", input_usd_per_mtok=1.0, output_usd_per_mtok=2.0, cached_input_usd_per_mtok=0.1)
    assert priced.estimate_cost(1000, 10, cached_tokens=800) == pytest.approx((200 * 1.0 + 800 * 0.1 + 10 * 2.0) / 1e6)


def test_cached_tokens_cost_litellms_cached_price_when_it_knows_one():
    prices = upstream(model="deepseek/deepseek-chat").prices
    assert 0 < prices.cached_input < prices.input and prices.output > 0  # DeepSeek's hit price: a tenth of a miss


def test_cache_writes_cost_litellms_write_price_or_the_configured_one():
    prices = upstream(model="anthropic/claude-haiku-4-5").prices
    assert prices.cache_write == pytest.approx(1.25 * prices.input)  # Anthropic's published write premium
    assert prices.worst_case(1000, 10) == pytest.approx(1000 * prices.cache_write + 10 * prices.output)
    configured = upstream(model="openai/x", input_usd_per_mtok=1.0, output_usd_per_mtok=2.0,
                          cache_write_usd_per_mtok=3.0)
    assert configured.prices.cache_write == pytest.approx(3e-6)
    assert upstream(model="openai/x", input_usd_per_mtok=1.0).prices.worst_case(10, 0) == pytest.approx(1e-5)


def test_no_discount_is_assumed_when_no_cached_price_is_known():
    priced = upstream(model="openai/x", input_usd_per_mtok=1.0, output_usd_per_mtok=2.0)
    assert priced.estimate_cost(1000, 0, cached_tokens=800) == priced.estimate_cost(1000, 0)
    unmapped = upstream(model="openai/not-a-mapped-model").prices
    assert (unmapped.input, unmapped.cached_input, unmapped.output, unmapped.cache_write) == (0.0, 0.0, 0.0, None)


@pytest.mark.parametrize(("model", "minimum"), [
    ("openai/gpt-4o", 1024), ("gpt-4o-mini", 1024), ("anthropic/claude-sonnet-4-5", 1024),
    ("deepseek/deepseek-chat", 64), ("text-completion-openai/qwen", 0), ("hosted_vllm/qwen", 0),
])
def test_the_providers_cache_minimum_follows_its_documentation(model, minimum):
    assert upstream(model=model, input_usd_per_mtok=1.0).prices.cache_min_prompt_tokens == minimum


def test_a_prediction_reads_the_previous_calls_prefix_from_the_cache_only_past_the_minimum():
    prices = upstream(model="openai/x", input_usd_per_mtok=1.0, output_usd_per_mtok=2.0,
                      cached_input_usd_per_mtok=0.1, cache_min_prompt_tokens=1024).prices
    assert prices.predicted(1000, 4, reusable_tokens=900) == pytest.approx((1000 * 1.0 + 4 * 2.0) / 1e6)
    assert prices.predicted(2000, 4, reusable_tokens=1900) == pytest.approx((100 + 1900 * 0.1 + 8) / 1e6)


def test_cache_hints_follow_each_providers_documented_form():
    from adapters.continuation_modes import cache_hints

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "partial"}]
    marked, extra = cache_hints("anthropic/claude-x", messages, "key")
    assert extra == {} and marked[2] == messages[2] and marked[0] == messages[0]
    assert marked[1]["content"] == [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]
    assert messages[1]["content"] == "q"  # the caller's messages are not changed
    assert cache_hints("openai/gpt-4o-mini", messages, "key") == (messages, {"prompt_cache_key": "key"})
    assert cache_hints("mistral/mistral-small", messages, "key")[1] == {"prompt_cache_key": "key"}
    assert cache_hints("deepseek/deepseek-chat", messages, "key") == (messages, {})  # caches on its own
