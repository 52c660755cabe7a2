"""What every admitted request goes through, token-level or passed through: rate limits, the
budget's headroom, and the parallel slot it gives back when it ends."""

from __future__ import annotations

import asyncio
import dataclasses

from adapters.store import StoreUnavailable
from gateway.runtime import Runtime
from gateway.tenancy.budget import HandoffGate
from gateway.tenancy.tenants import Tenant
from gateway.wire.errors import QuotaExceeded, RateLimited


async def admit_rates(runtime: Runtime, tenant: Tenant, gate: HandoffGate, request_id: str) -> None:
    """Requests per minute, parallel slots and budget at admission, before any work on the request
    (its tokens are counted by `admit_tokens` once its prompt is tokenized). A store fault never
    fails the request: it is admitted unmetered, and each upstream call asks the store again. An
    exhausted budget refuses (429) or closes the gate, as the tenant's `on_budget_exhausted` says."""
    store, now = runtime.ledger.store, runtime.ledger.clock()
    requests_only = dataclasses.replace(tenant.rate_limits, tokens_per_minute=None)
    try:
        wait = await store.admit(tenant.id, request_id, requests_only, 0, now)
        if wait is not None:
            raise RateLimited("rate limit reached for this tenant", wait)
        await store.count_request(tenant.id, now)
        if gate.allowed and not gate.limits.unlimited:
            gate.headroom = await store.headroom(tenant.id, gate.limits, now)
    except StoreUnavailable:
        return
    except asyncio.CancelledError:  # the request ended mid-admission: the store may hold its slot
        await asyncio.shield(release(runtime, tenant, request_id))
        raise
    if gate.headroom is not None and gate.headroom.exhausted:
        if tenant.settings.on_budget_exhausted == "refuse":
            await release(runtime, tenant, request_id)
            raise QuotaExceeded("You exceeded your upstream budget for this period.")
        gate.allowed, gate.refusal = False, "budget_exhausted"


async def admit_tokens(runtime: Runtime, tenant: Tenant, request_id: str, tokens: int) -> None:
    """Tokens per minute for an admitted request, once its prompt is tokenized (its prompt and the
    most its answers may take): a 429 that counts nothing, the parallel slot given back, if they do
    not fit this minute. A store fault admits them unmetered, as `admit_rates` does."""
    limit = tenant.rate_limits.tokens_per_minute
    if limit is None:
        return
    try:
        wait = await runtime.ledger.store.admit_tokens(tenant.id, tokens, limit, runtime.ledger.clock())
    except StoreUnavailable:
        return
    if wait is not None:
        await release(runtime, tenant, request_id)
        raise RateLimited("rate limit reached for this tenant", wait)


async def release(runtime: Runtime, tenant: Tenant, request_id: str) -> None:
    """Give back the request's parallel slot (queued while the store is down; it also expires)."""
    if tenant.settings.rate_limits.max_parallel is not None:
        await runtime.ledger.release_slot(tenant.id, request_id)
