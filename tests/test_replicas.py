"""Three gateway replicas on one Redis, as behind a load balancer: what must be shared is shared.

Rate limits count across replicas, a request's usage is visible from any replica right after it
ends, and a capped tenant's concurrent spending on all of them stays within its budget plus one
reservation per replica; replicas sharing one llama-server agree on which tenant's prompts each of
its slots holds. (Per replica, by design: the local model and its cached prefixes, the upstream's
circuit breaker, target_fraction's window.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import httpx
import openai
import pytest

from adapters.upstream_server import forgetful_args
from tests.conftest import DEMO_KEY, gateway_config, live_gateway, upstream_server

pytestmark = pytest.mark.integration

KEYS = {"TEST_RPM_KEY": "sk-rpm", "TEST_CAPPED_KEY": "sk-capped"}
RPM = 4
BUDGET = 600  # upstream tokens a day for the capped tenant
ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def replicas(smol_upstream, redis_url, tmp_path_factory):
    prefix = f"test-replicas-{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("replicas")
    with contextlib.ExitStack() as stack:
        gateways = []
        for _ in range(3):
            config = gateway_config(smol_upstream, store={"backend": "redis", "url": redis_url, "key_prefix": prefix})
            config["tenants"] += [
                {"id": "rpm", "api_key_env": "TEST_RPM_KEY", "rate_limits": {"requests_per_minute": RPM}},
                {"id": "capped", "api_key_env": "TEST_CAPPED_KEY", "daily": {"upstream_tokens": BUDGET}},
            ]
            gateways.append(stack.enter_context(live_gateway(config, tmp, env=KEYS)))
        yield gateways


def day_usage(gateway, key: str) -> dict:
    usage = httpx.get(f"{gateway.base_url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    return next(w for w in usage["windows"] if w["period"] == "day")


def test_a_rate_limit_counts_requests_on_every_replica(replicas):
    for _ in range(2):  # a burst that straddles a minute's turn is tried once more
        minute = int(time.time() // 60)
        statuses = []
        for i in range(RPM + 2):
            response = httpx.post(f"{replicas[i % 3].base_url}/v1/chat/completions", timeout=60,
                                  headers={"Authorization": "Bearer sk-rpm"},
                                  json={"model": "local", "messages": ASK, "max_tokens": 1})
            statuses.append(response.status_code)
        if int(time.time() // 60) == minute:
            break
        time.sleep(61 - time.time() % 60)  # a fresh minute, with its own count
    assert statuses == [200] * RPM + [429, 429]


def test_usage_is_visible_from_any_replica_right_after_a_request(replicas):
    before = day_usage(replicas[2], DEMO_KEY)
    client = openai.OpenAI(base_url=f"{replicas[0].base_url}/v1", api_key=DEMO_KEY, max_retries=0)
    answer = client.chat.completions.create(model="routed", messages=ASK, max_tokens=3, temperature=0,
                                            extra_body={"routing": {"policy": "always"}})
    routing = answer.usage.model_extra["routing"]
    after = day_usage(replicas[2], DEMO_KEY)
    assert routing["upstream_prompt_tokens"] > 0
    assert after["upstream_prompt_tokens"] - before["upstream_prompt_tokens"] == routing["upstream_prompt_tokens"]
    assert after["requests"] - before["requests"] == 1


def test_a_capped_tenant_spends_within_its_budget_across_replicas(replicas):
    async def burst() -> list[dict]:
        async def one(i: int) -> dict:
            client = openai.AsyncOpenAI(base_url=f"{replicas[i % 3].base_url}/v1", api_key="sk-capped", max_retries=0)
            answer = await client.chat.completions.create(
                model="routed", messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}], max_tokens=24,
                temperature=0, extra_body={"routing": {"policy": "always"}})
            return answer.usage.model_extra["routing"]

        return await asyncio.gather(*(one(i) for i in range(9)))

    routings = asyncio.run(burst())
    used = day_usage(replicas[1], "sk-capped")
    spent = used["upstream_prompt_tokens"] + used["upstream_completion_tokens"]
    biggest_call = max(r["upstream_prompt_tokens"] // max(1, r["upstream_calls"]) + 1 for r in routings
                       if r["upstream_calls"])
    assert sum(r["upstream_prompt_tokens"] + r["upstream_completion_tokens"] for r in routings) == spent
    assert any("budget_exhausted" in r["degraded"] for r in routings)  # the budget ran out mid-burst
    assert spent <= BUDGET + 3 * biggest_call, (spent, biggest_call)  # at most one reservation per replica past it


OTHER_KEY = "sk-other-tenant"
LONG_ASK = [{"role": "user", "content": "Here is a long note about the history of colour names in many languages, "
                                        "from ancient dyes to modern paint charts, and why some languages name "
                                        "blue late. Summarize it in one word."}]


@pytest.fixture(scope="module")
def isolated_replicas(smol_path, redis_url, tmp_path_factory):
    """Two replicas sharing one llama-server that keeps prompts only in its two slots (tenant isolation)."""
    prefix = f"test-slots-{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("isolated-replicas")
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(upstream_server(smol_path, "smol-isolated", server="llama-server",
                                                   extra_args=tuple(forgetful_args())))
        gateways = []
        for _ in range(2):
            store = {"backend": "redis", "url": redis_url, "key_prefix": prefix}
            config = gateway_config(base, mode="tokens", store=store)
            config["upstreams"]["up"].update(kind="llama-server", slots=2, cache_isolation="tenant")
            config["tenants"].append({"id": "other", "api_key_env": "TEST_OTHER_KEY"})
            gateways.append(stack.enter_context(live_gateway(config, tmp, env={"TEST_OTHER_KEY": OTHER_KEY})))
        yield gateways


def cached_on_first_handoff(gateway, key: str) -> int:
    client = gateway.client(key)
    # sampled, so that the continuation cache (greedy hand-offs only) does not answer instead
    answer = client.chat.completions.create(model="routed", messages=LONG_ASK, max_tokens=1, temperature=0.7, seed=1,
                                            extra_body={"routing": {"policy": "always"}})
    routing = answer.usage.model_extra["routing"]
    assert routing["upstream_calls"] == 1
    return routing["upstream_cached_tokens"]


def test_replicas_sharing_an_upstream_agree_on_whose_prompts_each_slot_holds(isolated_replicas):
    first, second = isolated_replicas
    cached_on_first_handoff(first, DEMO_KEY)
    assert cached_on_first_handoff(first, DEMO_KEY) > 0  # the tenant's own slot: its prefix is cached
    # the other replica's first call for another tenant: with slot leases kept per replica it took
    # slot 0 (unused, as far as it knew), which held the first tenant's prompt, and read it cached
    assert cached_on_first_handoff(second, OTHER_KEY) == 0
    assert cached_on_first_handoff(second, OTHER_KEY) > 0  # and now its own slot holds its prompt
    assert cached_on_first_handoff(second, DEMO_KEY) > 0  # the first tenant's slot, from either replica
