"""What shadow calls spend: the operator's budget, and one tenant's share of it (`shadow.tenant_share`),
each a ledger of its own (never a client tenant's); a shadow call's reservations are settled or
released together (`Spend`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from adapters.store import Limits, Reservation
from adapters.upstream import Continuation
from gateway.tenancy.budget import HandoffGate, billed


@dataclass
class Spend:
    """One shadow call's reservations (the tenant's share, the operator's), settled or released together."""

    held: list[tuple[HandoffGate, Reservation]] = field(default_factory=list)

    async def settle(self, got: Continuation) -> None:
        for gate, reservation in self.held:
            await gate.settle(reservation, billed(got))

    async def release(self) -> None:
        for gate, reservation in self.held:
            await gate.release(reservation)

    def finish_in_background(self, call: asyncio.Future) -> None:
        """Shut down mid-call: each ledger bills what the call reports once it ends (see HandoffGate)."""
        for gate, reservation in self.held:
            gate.finish_in_background(reservation, call, lambda done, g=gate, r=reservation: g.settle(r, billed(done)))


def share_ledger(operator: str, tenant: str) -> str:
    """The ledger id of one tenant's shadow spending: never a client tenant's own (tenant ids hold no ':')."""
    return f"{operator}:{tenant}"


def tenant_share_limits(limits: Limits, share: float) -> Limits | None:
    """`share` of the operator's `limits`, one tenant's bound; None when there is none to share (an
    unlimited operator, or a share of 1)."""
    if limits.unlimited or share >= 1:
        return None

    def tokens(limit: int | None) -> int | None:
        return None if limit is None else int(limit * share)

    def cost(limit: float | None) -> float | None:
        return None if limit is None else limit * share

    return Limits(tokens(limits.day_tokens), cost(limits.day_cost_usd), tokens(limits.month_tokens),
                  cost(limits.month_cost_usd))
