"""Who gets the local engine's next free sequence: fair between tenants and between requests.

A request may decode several sequences at once (its `n` choices, an agreement check's samples).
Handed out first come, first served, one such request could hold every sequence and queue dozens
more, and every other request would wait behind all of them. So free sequences go instead:

1. to a waiter whose request holds none yet before one whose request already holds some. A
   request's extra sequences take one only while the engine has no other request (none holds a
   sequence or waits for one) and another sequence stays free: so a request decodes one answer at a
   time beside others, and a newcomer starts at once unless every sequence is held by a different
   request's first;
2. among those, to the tenant holding fewest sequences, then the request holding fewest, then
   the earliest.

`QueueFull` counts only the waiters a newcomer would wait behind: first sequences of requests.
Everything here runs on the event loop; no llama.cpp call is involved. Once granted, the engine's
step loop shares each step the same way (Engine._turn): while several requests have a sequence
ready, each decodes one of its sequences per step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

_unique = itertools.count()


class QueueFull(Exception):
    """Too many requests are already waiting for a sequence of the local model."""


@dataclass(frozen=True)
class Claim:
    """Whose sequence it is: a tenant's request. A request's choices and agreement samples share
    one claim; a sequence opened with none is a request of its own."""

    tenant: str = ""
    request: str = field(default_factory=lambda: f"#{next(_unique)}")


@dataclass(eq=False)
class _Waiter:
    claim: Claim
    pick: Callable[[list[int]], int]  # which of the free slots suits it best
    granted: asyncio.Future


class SlotQueue:
    """`size` slots handed out by the rules in the module's docstring; at most `queue_limit`
    requests wait for their first one."""

    def __init__(self, size: int, queue_limit: int) -> None:
        self._size = size
        self._queue_limit = queue_limit
        self._holders: dict[int, Claim] = {}
        self._waiting: list[_Waiter] = []

    @property
    def held(self) -> int:
        return len(self._holders)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def check_admission(self) -> None:
        """Raise QueueFull when a new request would wait behind `queue_limit` others."""
        ahead = sum(not self._holding(waiter.claim.request) for waiter in self._waiting)
        if self.held == self._size and ahead >= self._queue_limit:
            raise QueueFull(f"{ahead} requests are waiting for the local model")

    async def take(self, claim: Claim, pick: Callable[[list[int]], int]) -> int:
        """A slot for `claim`, once the rules give it one; `pick` chooses among the free slots."""
        waiter = _Waiter(claim, pick, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self._grant()
        try:
            return await waiter.granted
        except asyncio.CancelledError:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.granted.done() and not waiter.granted.cancelled():
                self.give_back(waiter.granted.result())  # granted as it was cancelled
            raise

    def give_back(self, slot: int) -> None:
        """`slot` is free again: hand it on."""
        del self._holders[slot]
        self._grant()

    def _grant(self) -> None:
        self._waiting = [waiter for waiter in self._waiting if not waiter.granted.done()]  # cancelled meanwhile
        while self._waiting and self.held < self._size:
            eligible = [waiter for waiter in self._waiting if self._may_take(waiter.claim)]
            if not eligible:
                return
            waiter = min(eligible, key=self._rank)  # min keeps the earliest of equals
            self._waiting.remove(waiter)
            slot = waiter.pick([index for index in range(self._size) if index not in self._holders])
            self._holders[slot] = waiter.claim
            waiter.granted.set_result(slot)

    def _may_take(self, claim: Claim) -> bool:
        if not self._holding(claim.request):
            return True
        return self._size - self.held >= 2 and not self._others_active(claim.request)

    def _others_active(self, request: str) -> bool:
        """Whether another request holds a slot or waits for one."""
        return any(claim.request != request for claim in self._holders.values()) or \
            any(waiter.claim.request != request for waiter in self._waiting)

    def _rank(self, waiter: _Waiter) -> tuple[int, int]:
        holders = self._holders.values()
        return (sum(c.tenant == waiter.claim.tenant for c in holders),
                sum(c.request == waiter.claim.request for c in holders))

    def _holding(self, request: str) -> bool:
        return any(claim.request == request for claim in self._holders.values())
