"""Budgets, degradation and the shared cache across gateway processes with a real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import httpx
import openai
import pytest

from tests.conftest import ADMIN_KEY, DEMO_KEY, free_port, gateway_config, live_gateway, private_redis, stop

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Name three colours."}]
BUDGET = 1500


def redis_store(url: str) -> dict:
    return {"backend": "redis", "url": url, "key_prefix": f"test-{uuid.uuid4().hex[:8]}", "timeout_s": 1.0}


async def ask_async(client: openai.AsyncOpenAI, **kw):
    params = dict(model="routed", messages=QUESTION, max_tokens=6, temperature=0,
                  extra_body={"routing": {"policy": "always"}})
    params.update(kw)
    return await client.chat.completions.create(**params)


def test_concurrent_requests_over_two_processes_respect_the_budget(smol_upstream, redis_url, tmp_path):
    config = gateway_config(smol_upstream, store=redis_store(redis_url))
    config["server"]["queue_limit"] = 64
    config["tenants"][0]["daily"] = {"upstream_tokens": BUDGET}
    second = {**config, "server": {**config["server"], "port": free_port()}}
    with live_gateway(config, tmp_path) as one, live_gateway(second, tmp_path) as two:
        async def burst():
            clients = [openai.AsyncOpenAI(base_url=f"{g.base_url}/v1", api_key=DEMO_KEY, max_retries=0, timeout=120)
                       for g in (one, two)]
            # distinct seeds in the prompt text keep the shared cache from answering for free
            return await asyncio.gather(*(
                ask_async(clients[i % 2], messages=[{"role": "user", "content": f"Name three colours. ({i})"}])
                for i in range(50)))

        answers = asyncio.run(burst())
        usage = httpx.get(f"{one.base_url}/admin/tenants/demo/usage",
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["windows"][0]
    billed = [a.usage.model_extra["routing"] for a in answers]
    reported = sum(r["upstream_prompt_tokens"] + r["upstream_completion_tokens"] for r in billed)
    ledger = usage["upstream_prompt_tokens"] + usage["upstream_completion_tokens"]
    one_reservation = max(r["upstream_prompt_tokens"] // max(r["upstream_calls"], 1) for r in billed) + 1
    reasons = Counter(reason for r in billed for reason in r["degraded"])
    assert ledger == reported
    assert ledger <= BUDGET + one_reservation
    assert ledger >= 0.8 * BUDGET, f"ledger {ledger} of {BUDGET}; degraded: {dict(reasons)}"
    assert usage["requests"] == 50
    assert all(a.choices[0].message.content for a in answers)
    assert sum("budget_exhausted" in r["degraded"] for r in billed) > 0


def test_redis_outage_degrades_to_local_and_recovers(smol_upstream, tmp_path):
    port = free_port()
    with private_redis(port) as server:
        config = gateway_config(smol_upstream, store=redis_store(f"redis://127.0.0.1:{port}/0"))
        with live_gateway(config, tmp_path) as gateway:
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=DEMO_KEY, max_retries=0)
            ask = lambda: client.chat.completions.create(  # noqa: E731
                model="routed", messages=QUESTION, max_tokens=4, temperature=0.7, seed=int(time.time() * 1e3) % 1000,
                extra_body={"routing": {"policy": "always"}})
            assert ask().usage.model_extra["routing"]["upstream_calls"] > 0
            stop(server)
            for _ in range(3):
                down = ask().usage.model_extra["routing"]
                assert down["upstream_calls"] == 0 and down["upstream_prompt_tokens"] == 0
                assert "store_unavailable" in down["degraded"]
            ready = httpx.get(f"{gateway.base_url}/health/ready").json()
            assert ready["store"] == "unavailable" and ready["mode"] == "local_only"
            with private_redis(port):
                time.sleep(1.2)  # the store skips Redis for a second after a failure
                back = ask().usage.model_extra["routing"]
                assert back["upstream_calls"] > 0 and back["degraded"] == []
                assert httpx.get(f"{gateway.base_url}/health/ready").json()["store"] == "ok"


def test_shared_cache_answers_the_second_process_without_the_upstream(redis_url, tmp_path):
    """The upstream is a third (local-only) gateway, whose own request counter we can read.

    The same counter shows that a tenant with upstream forbidden never reaches it, and that the
    cache answers a tenant from its own entries only.
    """
    with live_gateway(gateway_config(None), tmp_path) as upstream:
        store = redis_store(redis_url)
        config = gateway_config(None, store=store)
        config["tenants"] += [{"id": "private", "api_key_env": "TEST_PRIVATE_KEY", "allow_upstream": False},
                              {"id": "other", "api_key_env": "TEST_OTHER_KEY"}]
        config["upstreams"]["inner"] = {"model": "openai/local", "api_base": f"{upstream.base_url}/v1",
                                        "api_key_env": "TEST_DEMO_KEY", "mode": "chat_continue", "retries": 0}
        config["aliases"]["routed"] = {"local": "smol", "upstream": "inner", "routing": {"policy": "always", "span": 4}}
        second = {**config, "server": {**config["server"], "port": free_port()}}
        env = {"TEST_PRIVATE_KEY": "sk-private", "TEST_OTHER_KEY": "sk-other"}
        with live_gateway(config, tmp_path, env) as one, live_gateway(second, tmp_path, env) as two:
            def upstream_requests() -> int:
                return httpx.get(f"{upstream.base_url}/v1/usage",
                                 headers={"Authorization": f"Bearer {DEMO_KEY}"}).json()["windows"][0]["requests"]

            def ask(gateway, key=DEMO_KEY, **kw):
                client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)
                return client.chat.completions.create(model="routed", messages=QUESTION, max_tokens=12, **kw)

            first = ask(one, temperature=0)
            after_first = upstream_requests()
            repeat = ask(two, temperature=0)
            assert upstream_requests() == after_first > 0
            private = ask(one, "sk-private", temperature=0.9, seed=5)  # not cacheable, and not allowed out
            assert upstream_requests() == after_first
            assert private.usage.model_extra["routing"]["upstream_calls"] == 0
            stranger = ask(two, "sk-other", temperature=0)  # the same request from another tenant
            assert upstream_requests() > after_first  # never served from the first tenant's cache
            assert stranger.usage.model_extra["routing"]["cache_tokens"] == 0
    assert repeat.choices[0].message.content == first.choices[0].message.content
    routing = repeat.usage.model_extra["routing"]
    assert routing["cache_tokens"] == repeat.usage.completion_tokens and routing["upstream_calls"] == 0
    assert first.usage.model_extra["routing"]["upstream_calls"] > 0
