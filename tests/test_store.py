"""Store semantics, the same for the in-process store and a real Redis server."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import time
import uuid
from datetime import datetime, timezone

import pytest
import redis

from adapters.cache_isolation import TenantSlots
from adapters.memory_store import MemoryStore
from adapters.redis_store import RedisStore
from adapters.store import (
    Billed,
    Limits,
    RateLimits,
    Reservation,
    ResponseQuota,
    Store,
    StoreFull,
    StoreUnavailable,
    new_reservation,
)
from adapters.upstream_errors import UpstreamUnavailable
from tests.conftest import _wait_redis, free_port, stop

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc).timestamp()
NEXT_DAY = datetime(2026, 12, 1, 0, 0, 1, tzinfo=timezone.utc).timestamp()


async def reserve(store: Store, tenant: str, tokens: int, cost_usd: float, limits: Limits, now: float,
                  ttl_s: float = 0.0) -> Reservation | None:
    """The reservation if the store held it, else None."""
    reservation = new_reservation(tenant, tokens, cost_usd)
    return reservation if await store.reserve(reservation, limits, now, ttl_s) else None


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def store(request, redis_url):
    if request.param == "memory":
        yield MemoryStore(reservation_ttl_s=30, cache_max_entries=3)
        return
    cluster = request.param == "redis-cluster"  # every test below also runs against a real three-node cluster
    url = request.getfixturevalue("redis_cluster_url") if cluster else redis_url
    real = RedisStore(url, f"test-{uuid.uuid4().hex[:8]}", timeout_s=1.0, reservation_ttl_s=30, cache_ttl_s=60,
                      cache_max_entries=3, cluster=cluster)
    yield real
    await real.close()


async def test_reserve_settle_release(store):
    limits = Limits(day_tokens=100)
    first = await reserve(store, "t", 60, 0.0, limits, NOW)
    assert first is not None
    assert await reserve(store, "t", 50, 0.0, limits, NOW) is None  # 60 held + 50 > 100
    await store.settle(first, Billed(30, 5, 0.01), NOW)
    assert (await store.headroom("t", limits, NOW)).tokens == 65
    second = await reserve(store, "t", 50, 0.0, limits, NOW)
    assert second is not None
    await store.release(second)
    day, month = await store.usage("t", NOW)
    assert (day.period, day.start, month.start) == ("day", "2026-11-30", "2026-11-01")
    assert (day.upstream_prompt_tokens, day.upstream_completion_tokens) == (30, 5)
    assert day.upstream_cost_usd == pytest.approx(0.01)
    assert (await store.headroom("t", limits, NOW)).tokens == 65


async def test_cost_and_monthly_limits(store):
    limits = Limits(day_cost_usd=1.0, month_tokens=500)
    spent = await reserve(store, "t", 10, 0.9, limits, NOW)
    await store.settle(spent, Billed(8, 2, 0.9), NOW)
    assert await reserve(store, "t", 10, 0.2, limits, NOW) is None  # cost
    assert await reserve(store, "t", 491, 0.0, limits, NOW) is None  # month tokens
    assert await reserve(store, "t", 490, 0.0, limits, NOW) is not None


async def test_reservation_of_a_dead_process_expires(store):
    limits = Limits(day_tokens=100)
    assert await reserve(store, "t", 100, 0.0, limits, NOW) is not None  # never settled
    assert await reserve(store, "t", 1, 0.0, limits, NOW + 10) is None
    assert await reserve(store, "t", 100, 0.0, limits, NOW + 31) is not None


async def test_window_rollover_resets_the_counters(store):
    limits = Limits(day_tokens=100, month_tokens=1000)
    reservation = await reserve(store, "t", 100, 0.0, limits, NOW)
    await store.settle(reservation, Billed(90, 10, 0.0), NOW)
    await store.count_request("t", NOW)
    assert await reserve(store, "t", 1, 0.0, limits, NOW) is None
    assert await reserve(store, "t", 100, 0.0, limits, NEXT_DAY) is not None  # new day, new month
    day, month = await store.usage("t", NEXT_DAY)
    assert (day.start, day.requests, day.upstream_prompt_tokens) == ("2026-12-01", 0, 0)
    assert month.start == "2026-12-01" and month.upstream_prompt_tokens == 0


async def test_concurrent_reservations_never_pass_the_limit(store):
    limits = Limits(day_tokens=1000)
    results = await asyncio.gather(*(reserve(store, "t", 30, 0.0, limits, NOW) for _ in range(100)))
    assert sum(r is not None for r in results) == 33


async def test_rate_limits_and_parallel_slots(store):
    per_minute = RateLimits(requests_per_minute=2)
    assert await store.admit("t", "a", per_minute, 10, NOW) is None
    assert await store.admit("t", "b", per_minute, 10, NOW) is None
    wait = await store.admit("t", "c", per_minute, 10, NOW)
    assert wait is not None and 0 < wait <= 60
    assert await store.admit("t", "c", per_minute, 10, NOW + 60) is None  # next minute
    parallel = RateLimits(max_parallel=1)
    assert await store.admit("u", "d", parallel, 0, NOW) is None
    assert await store.admit("u", "e", parallel, 0, NOW) == 1.0
    await store.release_slot("u", "d")
    assert await store.admit("u", "e", parallel, 0, NOW) is None


async def test_tokens_per_minute_and_refusals_count_nothing(store):
    limits = RateLimits(tokens_per_minute=100)
    assert await store.admit("t", "a", limits, 60, NOW) is None
    assert await store.admit("t", "b", limits, 60, NOW) is not None  # 120 > 100
    assert await store.admit("t", "c", limits, 40, NOW) is None  # the refused 60 were not counted
    assert await store.admit("t", "d", limits, 1, NOW) is not None


async def test_cache_round_trip(store):
    assert await store.cache_get("k") is None
    await store.cache_put("k", "0 Paris")
    assert await store.cache_get("k") == "0 Paris"


async def test_stored_responses_are_per_tenant_and_deletable(store):
    await store.response_put("alice", "resp_1", '{"id": "resp_1"}', ttl_s=60)
    assert await store.response_get("alice", "resp_1") == '{"id": "resp_1"}'
    assert await store.response_get("bob", "resp_1") is None  # another tenant never reads it
    assert await store.response_delete("bob", "resp_1") is False
    assert await store.response_delete("alice", "resp_1") is True
    assert await store.response_get("alice", "resp_1") is None
    assert await store.response_delete("alice", "resp_1") is False


async def test_stored_responses_expire(store):
    await store.response_put("alice", "resp_2", "{}", ttl_s=1)
    assert await store.response_get("alice", "resp_2") == "{}"
    await asyncio.sleep(1.1)
    assert await store.response_get("alice", "resp_2") is None


async def test_stored_responses_stop_at_the_tenants_quota(store):
    two = ResponseQuota(count=2, bytes=1000)
    await store.response_put("alice", "resp_1", "{}", ttl_s=60, quota=two)
    await store.response_put("alice", "resp_2", "{}", ttl_s=60, quota=two)
    with pytest.raises(StoreFull):
        await store.response_put("alice", "resp_3", "{}", ttl_s=60, quota=two)
    assert await store.response_get("alice", "resp_3") is None  # nothing written
    await store.response_put("bob", "resp_3", "{}", ttl_s=60, quota=two)  # another tenant's quota is its own
    assert await store.response_delete("alice", "resp_1") is True  # a deleted one frees its share
    await store.response_put("alice", "resp_3", "{}", ttl_s=60, quota=two)
    small = ResponseQuota(count=100, bytes=10)
    await store.response_put("carol", "resp_4", '"\u00e9"' + "x" * 4, ttl_s=1, quota=small)  # 8 bytes (é: 2)
    with pytest.raises(StoreFull):
        await store.response_put("carol", "resp_5", "xxx", ttl_s=60, quota=small)
    await asyncio.sleep(1.1)  # an expired one frees its share too
    await store.response_put("carol", "resp_5", "x" * 10, ttl_s=60, quota=small)


async def test_a_near_full_store_keeps_no_text_but_still_meters(near_full):
    """The store-wide guard: past it no stored response or cached continuation is written, while
    reservations, settlements and rate limits go on as before (they must always have room)."""
    with pytest.raises(StoreFull):
        await near_full.cache_put("k", "0 Paris")
    with pytest.raises(StoreFull):
        await near_full.response_put("alice", "resp_1", "{}", ttl_s=60)
    assert await near_full.cache_get("k") is None and await near_full.response_get("alice", "resp_1") is None
    held = await reserve(near_full, "t", 10, 0.0, Limits(day_tokens=100), NOW)
    assert held is not None
    await near_full.settle(held, Billed(5, 5, 0.0), NOW)
    assert await near_full.admit("t", "a", RateLimits(requests_per_minute=5), 10, NOW) is None
    assert (await near_full.headroom("t", Limits(day_tokens=100), NOW)).tokens == 90


@pytest.fixture(params=["memory", "redis"])
async def near_full(request):
    """A store past its guard: the in-process one at its byte cap, a Redis (a server of its own,
    `noeviction`) filled past 80% of its maxmemory."""
    if request.param == "memory":
        store = MemoryStore(max_bytes=64)
        await store.cache_put("filler", "x" * 64)
        yield store
        return
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--maxmemory", "16mb", "--maxmemory-policy", "noeviction"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_redis(port)
        url = f"redis://127.0.0.1:{port}/0"
        store = RedisStore(url, "test", timeout_s=1.0, reservation_ttl_s=30, cache_ttl_s=60)
        await store.cache_put("k0", "written while there is room")
        filler = redis.Redis.from_url(url)
        while filler.info("memory")["used_memory"] < 0.85 * 16 * 2**20:  # past 80%, short of 100%
            filler.set(f"filler:{uuid.uuid4().hex}", "x" * 500_000)
        await asyncio.sleep(1.1)  # the store reads INFO memory again after a second
        yield store
        await store.close()
    finally:
        stop(server)


async def test_settling_twice_bills_once(store):
    limits = Limits(day_tokens=100)
    reservation = await reserve(store, "t", 50, 0.0, limits, NOW)
    await store.settle(reservation, Billed(20, 5, 0.01), NOW)
    await store.settle(reservation, Billed(20, 5, 0.01), NOW)  # a retry after a lost reply
    day, _ = await store.usage("t", NOW)
    assert (day.upstream_prompt_tokens, day.upstream_completion_tokens) == (20, 5)
    assert day.upstream_cost_usd == pytest.approx(0.01)


async def test_a_reservation_lasts_as_long_as_its_call_may(store):
    limits = Limits(day_tokens=100)
    assert await reserve(store, "t", 100, 0.0, limits, NOW, ttl_s=90) is not None  # store default: 30 s
    assert await reserve(store, "t", 1, 0.0, limits, NOW + 60) is None  # still held
    assert await reserve(store, "t", 100, 0.0, limits, NOW + 91) is not None


async def test_cache_keeps_only_the_newest_entries(store):
    for index in range(5):
        await store.cache_put(f"k{index}", f"v{index}")
    assert [await store.cache_get(f"k{index}") for index in range(5)] == [None, None, "v2", "v3", "v4"]


async def test_a_busy_event_loop_does_not_look_like_a_redis_outage(redis_url):
    real = RedisStore(redis_url, f"test-{uuid.uuid4().hex[:8]}", timeout_s=0.1, reservation_ttl_s=30, cache_ttl_s=60)
    calls = [asyncio.create_task(real.usage("t", NOW)) for _ in range(3)]
    await asyncio.sleep(0)  # the calls are sent...
    time.sleep(0.5)  # ...and the loop is blocked (CPU work) far past the time-out while Redis answers
    assert all(len(windows) == 2 for windows in await asyncio.gather(*calls))
    await real.close()


async def test_unreachable_redis_raises_store_unavailable_quickly():
    dead = RedisStore("redis://127.0.0.1:1/0", "x", timeout_s=0.2, reservation_ttl_s=30, cache_ttl_s=60)
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(3):
        with pytest.raises(StoreUnavailable):
            await reserve(dead, "t", 1, 0.0, Limits(), NOW)
    with pytest.raises(StoreUnavailable, match="repeatedly"):  # now skipped without a network round trip
        await dead.usage("t", NOW)
    assert loop.time() - started < 1.0
    assert await dead.ping() is False
    await dead.close()


async def test_slot_leases_keep_one_scope_per_slot(store):
    server = f"srv-{uuid.uuid4().hex[:6]}"
    first = await store.slot_lease(server, 2, "tenant:a", "req1", ttl_s=30)
    assert first.erase is False
    second = await store.slot_lease(server, 2, "tenant:b", "req2", ttl_s=30)
    assert second.slot != first.slot and second.erase is False  # an unused slot before another's
    assert await store.slot_lease(server, 2, "tenant:c", "req3", ttl_s=30) is None  # both held
    await store.slot_release(server, first)
    await store.slot_release(server, second)
    again = await store.slot_lease(server, 2, "tenant:a", "req1", ttl_s=30)
    assert again.slot == first.slot and again.erase is False  # its own slot, still holding its prompts
    other = await store.slot_lease(server, 2, "tenant:c", "req3", ttl_s=30)
    assert other.slot == second.slot and other.erase is True  # b's prompts must go first


async def test_a_slot_lease_expires_and_only_its_holder_releases_it(store):
    server = f"srv-{uuid.uuid4().hex[:6]}"
    held = await store.slot_lease(server, 1, "tenant:a", "r", ttl_s=1)
    stale = dataclasses.replace(held, lease="someone-else")
    await store.slot_release(server, stale)  # not its holder: nothing happens
    assert await store.slot_lease(server, 1, "tenant:a", "r", ttl_s=1) is None
    await asyncio.sleep(1.1)  # a holder that died: its lease runs out
    taken = await store.slot_lease(server, 1, "tenant:b", "r2", ttl_s=30)
    assert taken is not None and taken.erase is True


async def test_a_slot_whose_erase_failed_is_erased_by_its_next_holder(store):
    server = f"srv-{uuid.uuid4().hex[:6]}"
    a = await store.slot_lease(server, 1, "tenant:a", "r", ttl_s=30)
    await store.slot_release(server, a)
    b = await store.slot_lease(server, 1, "tenant:b", "r", ttl_s=30)
    assert b.erase is True
    await store.slot_release(server, b, erased=False)  # a's prompts may still be there
    again = await store.slot_lease(server, 1, "tenant:b", "r", ttl_s=30)
    assert again.erase is True


async def test_a_lease_whose_reply_was_lost_is_released_by_its_id_and_its_slot_erased_next(store):
    server = f"srv-{uuid.uuid4().hex[:6]}"
    a = await store.slot_lease(server, 1, "tenant:a", "r", ttl_s=30)
    await store.slot_release(server, a)
    granted = await store.slot_lease(server, 1, "tenant:b", "r", ttl_s=30, lease="lost-reply")
    assert granted.lease == "lost-reply" and await store.slot_lease(server, 1, "tenant:c", "r", ttl_s=30) is None
    # the caller never learnt which slot, nor erased a's prompts: it releases whatever the id holds, unerased
    await store.slot_release(server, dataclasses.replace(granted, slot=-1), erased=False)
    again = await store.slot_lease(server, 1, "tenant:b", "r", ttl_s=30)
    assert again is not None and again.erase is True


async def test_tenant_slots_give_back_a_lease_whose_reply_was_lost():
    class LosesOneReply(MemoryStore):
        lose = True

        async def slot_lease(self, *args, **kwargs):
            held = await super().slot_lease(*args, **kwargs)
            if self.lose:
                self.lose = False
                raise StoreUnavailable("scripted: applied, reply lost")
            return held

    async def erase(slot: int) -> None:
        erased.append(slot)

    erased: list[int] = []
    slots = TenantSlots(1, erase, LosesOneReply(), "srv", hold_s=30, wait_s=0.1)
    with pytest.raises(UpstreamUnavailable):
        async with slots.lease("tenant:a", "r1"):
            pass
    async with slots.lease("tenant:a", "r2") as params:  # not held for 30 s: given back first, then erased
        assert params == {"id_slot": 0} and erased == [0]
