"""The ledger: settlements that could not be written are kept, written once each, and never lost."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from adapters.memory_store import MemoryStore
from adapters.store import (
    Billed,
    Limits,
    RateLimits,
    StoreSkipped,
    StoreUnavailable,
    new_reservation,
)
from gateway.admission.limits import admit_rates
from gateway.settings import RateLimitSettings, TenantSettings
from gateway.tenancy.budget import HandoffGate, Ledger
from gateway.tenancy.tenants import Tenant

NOW = 1_790_000_000.0


@dataclass
class FlakyStore(MemoryStore):
    """A MemoryStore whose settle yields to the loop (as a network call does) and can be down."""

    down: bool = False

    async def settle(self, reservation, billed, now) -> None:
        await asyncio.sleep(0.01)
        if self.down:
            raise StoreUnavailable("scripted outage")
        await super().settle(reservation, billed, now)


async def queued_settlements(store: FlakyStore, ledger: Ledger, count: int) -> None:
    store.down = True
    for _ in range(count):
        reservation = new_reservation("t", 10, 0.0)
        assert await store.reserve(reservation, Limits(), NOW)
        await ledger.settle(reservation, Billed(7, 1, 0.0))
    assert ledger.unsettled == count
    store.down = False


async def test_concurrent_flushes_write_each_settlement_exactly_once():
    store = FlakyStore()
    ledger = Ledger(store, clock=lambda: NOW)
    await queued_settlements(store, ledger, 3)
    await asyncio.gather(ledger.flush(), ledger.flush(), ledger.flush())
    day, _ = await store.usage("t", NOW)
    assert ledger.unsettled == 0
    assert (day.upstream_prompt_tokens, day.upstream_completion_tokens) == (21, 3)


async def test_queued_settlements_are_written_when_the_store_answers_again():
    store = FlakyStore()
    ledger = Ledger(store, clock=lambda: NOW)
    await queued_settlements(store, ledger, 2)
    flusher = asyncio.create_task(ledger.keep_flushing(interval_s=0.01))
    for _ in range(100):
        if ledger.unsettled == 0:
            break
        await asyncio.sleep(0.01)
    flusher.cancel()
    day, _ = await store.usage("t", NOW)
    assert ledger.unsettled == 0 and day.upstream_prompt_tokens == 14


async def test_a_slot_released_during_an_outage_is_given_back_when_the_store_answers():
    class Unreachable(MemoryStore):
        down = True

        async def release_slot(self, tenant, request_id):
            if self.down:
                raise StoreUnavailable("scripted outage")
            await super().release_slot(tenant, request_id)

    store = Unreachable()
    ledger = Ledger(store, clock=lambda: NOW)
    assert await store.admit("t", "r1", RateLimits(max_parallel=1), 0, NOW) is None
    await ledger.release_slot("t", "r1")
    assert ledger.unreleased == 1 and await store.admit("t", "r2", RateLimits(max_parallel=1), 0, NOW) == 1.0
    store.down = False
    await ledger.flush()
    assert ledger.unreleased == 0 and await store.admit("t", "r2", RateLimits(max_parallel=1), 0, NOW) is None


class LostReplies(MemoryStore):
    """A MemoryStore whose writes are applied but whose replies are lost while `down` (a Redis that
    dies right after running a command), or that skips calls altogether when `skipping`."""

    down = False
    skipping = False

    async def reserve(self, reservation, limits, now, ttl_s=0.0):
        if self.skipping:
            raise StoreSkipped("scripted skip")
        held = await super().reserve(reservation, limits, now, ttl_s)
        if self.down:
            raise StoreUnavailable("scripted lost reply")
        return held

    async def release(self, reservation):
        if self.down:
            raise StoreUnavailable("scripted outage")
        await super().release(reservation)


async def test_a_reservation_whose_reply_was_lost_is_released_when_the_store_answers():
    store = LostReplies()
    limits = Limits(day_tokens=100)
    gate = HandoffGate(Ledger(store, clock=lambda: NOW), "t", limits, allowed=True)
    store.down = True
    assert await gate.reserve(60, 0.0) is None and gate.refusal == "store_unavailable"
    assert gate.ledger.unreleased == 1 and (await store.headroom("t", limits, NOW)).tokens == 40  # held unseen
    store.down = False
    await gate.ledger.flush()
    assert gate.ledger.unreleased == 0 and (await store.headroom("t", limits, NOW)).tokens == 100


async def test_a_reservation_released_during_an_outage_is_released_when_the_store_answers():
    store = LostReplies()
    limits = Limits(day_tokens=100)
    gate = HandoffGate(Ledger(store, clock=lambda: NOW), "t", limits, allowed=True)
    reservation = await gate.reserve(60, 0.0)
    store.down = True
    await gate.release(reservation)
    assert gate.ledger.unreleased == 1
    store.down = False
    await gate.ledger.flush()
    assert (await store.headroom("t", limits, NOW)).tokens == 100


async def test_a_skipped_reserve_queues_nothing():
    store = LostReplies()
    gate = HandoffGate(Ledger(store, clock=lambda: NOW), "t", Limits(day_tokens=100), allowed=True)
    store.skipping = True
    assert await gate.reserve(60, 0.0) is None and gate.refusal == "store_unavailable"
    assert gate.ledger.unreleased == 0


class RepliesInFlight(MemoryStore):
    """A MemoryStore whose reserve is applied at once and answered never (the reply still in flight)."""

    async def reserve(self, reservation, limits, now, ttl_s=0.0):
        await super().reserve(reservation, limits, now, ttl_s)
        await asyncio.Event().wait()


async def test_a_reservation_whose_request_ended_before_the_reply_is_released():
    store = RepliesInFlight()
    limits = Limits(day_tokens=100)
    gate = HandoffGate(Ledger(store, clock=lambda: NOW), "t", limits, allowed=True)
    reserving = asyncio.ensure_future(gate.reserve(60, 0.0))
    await asyncio.sleep(0.01)
    assert (await store.headroom("t", limits, NOW)).tokens == 40  # held, the caller still waiting
    reserving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reserving
    assert (await store.headroom("t", limits, NOW)).tokens == 100


class HeadroomInFlight(MemoryStore):
    """A MemoryStore whose headroom read never answers (a reply still in flight)."""

    async def headroom(self, tenant, limits, now):
        await asyncio.Event().wait()


async def test_a_request_that_ends_mid_admission_gives_its_parallel_slot_back():
    store, one = HeadroomInFlight(), RateLimits(max_parallel=1)
    ledger = Ledger(store, clock=lambda: NOW)
    tenant = Tenant("t", TenantSettings(id="t", api_key_env="T_KEY", rate_limits=RateLimitSettings(max_parallel=1)))
    gate = HandoffGate(ledger, "t", Limits(day_tokens=100), allowed=True)
    admitting = asyncio.ensure_future(admit_rates(SimpleNamespace(ledger=ledger), tenant, gate, "r1"))
    await asyncio.sleep(0.01)
    assert await store.admit("t", "r2", one, 0, NOW) is not None  # r1 holds the one slot
    admitting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await admitting
    assert await store.admit("t", "r2", one, 0, NOW) is None
