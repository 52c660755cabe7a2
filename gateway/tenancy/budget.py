"""Upstream spending for tenants: an app-wide ledger over the Store, and a per-request gate.

The gate is what the decoder talks to. It never raises for a store fault: a reservation it
cannot take is a refusal (the step is decoded locally, and the next routed step asks again), and a
settlement it cannot write is queued in the ledger and written when the store answers again
(on the next call, or by `keep_flushing` in the background), so no billed call is lost. The
store settles each reservation at most once, so a queued settlement may be retried safely.
Releases wait in the same way, including that of a reservation whose reserve call failed (Redis
may have applied it and lost only the reply), so that no hold outlives its request by its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from adapters.store import (
    Billed,
    Headroom,
    Limits,
    Reservation,
    Store,
    StoreSkipped,
    StoreUnavailable,
    new_reservation,
)
from adapters.upstream import Continuation

log = logging.getLogger("gateway.tenancy.budget")
RESERVATION_MARGIN_S = 30.0  # a reservation outlives its call's worst case by this much


class Ledger:
    """The Store plus queues of what could not be written yet: settlements, and releases of
    parallel slots and reservations."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._unsettled: list[tuple[Reservation, Billed, float]] = []
        self._unreleased: list[Callable[[], Awaitable[None]]] = []  # store calls that give a hold back
        self._flushing = asyncio.Lock()  # two flushes at once would write one entry twice and drop the next
        self._finishing: set[asyncio.Task] = set()  # calls whose request ended before them (see finish_in_background)

    @property
    def unsettled(self) -> int:
        return len(self._unsettled)

    @property
    def unreleased(self) -> int:
        return len(self._unreleased)

    async def settle(self, reservation: Reservation, billed: Billed) -> None:
        now = self.clock()
        try:
            await self.flush()
            await self.store.settle(reservation, billed, now)
        except StoreUnavailable:
            log.warning("ledger unreachable; settlement of tenant %s queued", reservation.tenant)
            self._unsettled.append((reservation, billed, now))

    def run_in_background(self, work: Awaitable[None]) -> None:
        """Run `work` to its end in a task the ledger keeps (the event loop holds tasks only weakly)."""
        task = asyncio.ensure_future(work)
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def release_slot(self, tenant: str, request_id: str) -> None:
        """Give back a request's parallel slot, now or once the store answers again: a slot left
        held would refuse the tenant's requests until it expires."""
        await self._release(lambda: self.store.release_slot(tenant, request_id))

    async def release(self, reservation: Reservation, tried: bool = True) -> None:
        """Drop an unspent reservation, now or once the store answers again (`tried=False`: only then,
        since the store has just failed)."""
        if tried:
            await self._release(lambda: self.store.release(reservation))
        else:
            self._unreleased.append(lambda: self.store.release(reservation))

    async def _release(self, call: Callable[[], Awaitable[None]]) -> None:
        try:
            await call()
        except StoreUnavailable:
            self._unreleased.append(call)

    async def flush(self) -> None:
        """Write queued settlements and releases; raises StoreUnavailable if the store is still down."""
        if not (self._unsettled or self._unreleased):
            return
        async with self._flushing:
            while self._unsettled:
                reservation, billed, when = self._unsettled[0]
                await self.store.settle(reservation, billed, when)
                self._unsettled.pop(0)
            while self._unreleased:
                await self._unreleased[0]()
                self._unreleased.pop(0)

    async def keep_flushing(self, interval_s: float = 1.0) -> None:
        """Run until cancelled: write queued settlements as soon as the store answers again."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.flush()
            except StoreUnavailable:
                pass


@dataclass
class HandoffGate:
    """One request's door to upstream spending: reserve before a call, settle or release after."""

    ledger: Ledger | None
    tenant: str
    limits: Limits
    allowed: bool
    headroom: Headroom | None = None  # as read at admission; None when unknown or unlimited
    refusal: str = "budget_exhausted"
    cache_scope: str = ""  # continuation-cache namespace: the tenant's own unless it shares one
    cache_writes: bool = True  # False: the request leaves nothing behind (store: false)

    def tokens_left(self) -> int | None:
        return None if self.headroom is None else self.headroom.tokens

    def __post_init__(self) -> None:
        self.cache_scope = self.cache_scope or f"tenant:{self.tenant}"

    async def reserve(self, tokens: int, cost_usd: float, ttl_s: float = 0.0) -> Reservation | None:
        """A reservation held for at least `ttl_s`, or None (see `refusal` for why).

        `store_unavailable` is a refusal of this call only; the others hold for the request."""
        if self.ledger is None or not self.allowed:
            self.refusal = "upstream_forbidden"
            return None
        reservation = new_reservation(self.tenant, tokens, cost_usd)
        try:
            await self.ledger.flush()
        except StoreUnavailable:
            self.refusal = "store_unavailable"
            return None
        try:
            held = await self.ledger.store.reserve(reservation, self.limits, self.ledger.clock(), ttl_s)
        except StoreUnavailable as fault:
            if not isinstance(fault, StoreSkipped):  # Redis may have held it and lost only the reply
                await self.ledger.release(reservation, tried=False)
            self.refusal = "store_unavailable"
            return None
        except asyncio.CancelledError:  # the request ended (client gone) with the reply in flight:
            await asyncio.shield(self.ledger.release(reservation))  # Redis may have held it
            raise
        if not held:
            self.refusal = "budget_exhausted"
        return reservation if held else None

    async def settle(self, reservation: Reservation, billed: Billed) -> None:
        await self.ledger.settle(reservation, billed)
        if self.headroom is not None and self.headroom.tokens is not None:
            self.headroom = Headroom(self.headroom.tokens - billed.tokens, self.headroom.cost_usd)

    async def release(self, reservation: Reservation) -> None:
        await self.ledger.release(reservation)

    def finish_in_background(self, reservation: Reservation, call: asyncio.Future,
                             settle: Callable[[Any], Awaitable[None]]) -> None:
        """The request ended (its client left) with `call` in flight. The upstream bills the call all
        the same, so it runs to its end in the background and `settle(result)` bills what it
        reports; a call that fails gives `reservation` back."""
        async def finish() -> None:
            try:
                result = await call
            except BaseException:  # noqa: BLE001 - failed, refused or cancelled at shutdown: nothing billed
                await self.release(reservation)
                return
            await settle(result)

        self.ledger.run_in_background(finish())

    async def cache_get(self, key: str) -> str | None:
        try:
            return await self.ledger.store.cache_get(key) if self.ledger else None
        except StoreUnavailable:
            return None

    async def cache_put(self, key: str, value: str) -> None:
        try:
            if self.ledger and self.cache_writes:
                await self.ledger.store.cache_put(key, value)
        except StoreUnavailable:
            pass


def billed(continuation: Continuation) -> Billed:
    """What the ledger is told an upstream call billed."""
    return Billed(continuation.prompt_tokens, continuation.completion_tokens, continuation.cost_usd,
                  continuation.cached_tokens, continuation.compute_ms or 0.0)
