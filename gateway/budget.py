"""Upstream spending for tenants: an app-wide ledger over the Store, and a per-request gate.

The gate is what the decoder talks to. It never raises for a store fault: a reservation it
cannot take is a refusal (the step is decoded locally), and a settlement it cannot write is
queued in the ledger and written when the store answers again, so no billed call is lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from adapters.store import Billed, Headroom, Limits, Reservation, Store, StoreUnavailable

log = logging.getLogger("gateway.budget")


class Ledger:
    """The Store plus a queue of settlements that could not be written yet."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._unsettled: list[tuple[Reservation, Billed, float]] = []

    @property
    def unsettled(self) -> int:
        return len(self._unsettled)

    async def settle(self, reservation: Reservation, billed: Billed) -> None:
        now = self.clock()
        try:
            await self.flush()
            await self.store.settle(reservation, billed, now)
        except StoreUnavailable:
            log.warning("ledger unreachable; settlement of tenant %s queued", reservation.tenant)
            self._unsettled.append((reservation, billed, now))

    async def flush(self) -> None:
        """Write queued settlements; raises StoreUnavailable if the store is still down."""
        while self._unsettled:
            reservation, billed, when = self._unsettled[0]
            await self.store.settle(reservation, billed, when)
            self._unsettled.pop(0)


@dataclass
class HandoffGate:
    """One request's door to upstream spending: reserve before a call, settle or release after."""

    ledger: Ledger | None
    tenant: str
    limits: Limits
    allowed: bool
    headroom: Headroom | None = None  # as read at admission; None when unknown or unlimited
    refusal: str = "budget_exhausted"

    def tokens_left(self) -> int | None:
        return None if self.headroom is None else self.headroom.tokens

    async def reserve(self, tokens: int, cost_usd: float) -> Reservation | None:
        """A reservation, or None (see `refusal` for why)."""
        if self.ledger is None or not self.allowed:
            self.refusal = "upstream_forbidden"
            return None
        try:
            await self.ledger.flush()
            reservation = await self.ledger.store.reserve(self.tenant, tokens, cost_usd, self.limits, self.ledger.clock())
        except StoreUnavailable:
            self.refusal = "store_unavailable"
            return None
        if reservation is None:
            self.refusal = "budget_exhausted"
        return reservation

    async def settle(self, reservation: Reservation, billed: Billed) -> None:
        await self.ledger.settle(reservation, billed)
        if self.headroom is not None and self.headroom.tokens is not None:
            self.headroom = Headroom(self.headroom.tokens - billed.tokens, self.headroom.cost_usd)

    async def release(self, reservation: Reservation) -> None:
        try:
            await self.ledger.store.release(reservation)
        except StoreUnavailable:
            pass  # the reservation expires on its own

    async def cache_get(self, key: str) -> str | None:
        try:
            return await self.ledger.store.cache_get(key) if self.ledger else None
        except StoreUnavailable:
            return None

    async def cache_put(self, key: str, value: str) -> None:
        try:
            if self.ledger:
                await self.ledger.store.cache_put(key, value)
        except StoreUnavailable:
            pass
