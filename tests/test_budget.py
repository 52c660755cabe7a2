"""The ledger: settlements that could not be written are kept, written once each, and never lost."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from adapters.store import Billed, Limits, MemoryStore, RateLimits, StoreUnavailable
from gateway.admission.budget import Ledger

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
        reservation = await store.reserve("t", 10, 0.0, Limits(), NOW)
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
