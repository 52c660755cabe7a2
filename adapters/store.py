"""The Store seam: per-tenant usage ledger, budget reservations, rate limits and a text cache.

Budgets are enforced by reservation: before an upstream call the decoder reserves its estimated
billed tokens (and cost) against every window of the tenant; the store refuses atomically if
used + reserved + asked would pass a limit. After the call, `settle` replaces the reservation
with what was actually billed; `release` drops it unspent. A reservation expires on its own
after its time-to-live (at least the store's `reservation_ttl_s`, longer when the caller asks for
the worst-case duration of its call), so one left behind by a dead process cannot block a tenant
for long. Settlement is exactly-once per reservation id: a retried settle (after a reply that was
lost) bills nothing twice. The continuation cache is bounded in time (TTL) and size (LRU entries);
stored responses by a quota per tenant (count and bytes). Neither is written while the store is
near full (`StoreFull`), so that budgets and rate limits always have room.
Slot leases hand out a llama-server upstream's slots to calls, one scope's prompts per slot, the
same way in every process that shares the store.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol


class StoreUnavailable(Exception):
    """The store could not be reached in time; callers degrade to local-only, spending nothing.

    A write that fails this way may still have been applied (the reply was lost, not the command)."""


class StoreSkipped(StoreUnavailable):
    """Not even tried, since the store failed repeatedly just now: nothing was written."""


class StoreFull(StoreUnavailable):
    """A stored response or cached continuation refused: the store is near full (room is kept for
    budgets and rate limits) or the tenant's stored responses are at their quota. Nothing was written."""


@dataclass(frozen=True)
class ResponseQuota:
    """The most stored responses one tenant keeps at once, by count and by bytes (UTF-8)."""

    count: int
    bytes: int


@dataclass(frozen=True)
class Limits:
    """Per-window budget limits; None means unlimited."""

    day_tokens: int | None = None
    day_cost_usd: float | None = None
    month_tokens: int | None = None
    month_cost_usd: float | None = None

    @property
    def unlimited(self) -> bool:
        return all(v is None for v in (self.day_tokens, self.day_cost_usd, self.month_tokens, self.month_cost_usd))


@dataclass(frozen=True)
class RateLimits:
    """Per-tenant rate limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_parallel: int | None = None


@dataclass(frozen=True)
class Reservation:
    tenant: str
    id: str
    tokens: int
    cost_micro: int


@dataclass(frozen=True)
class Billed:
    """One upstream call as billed. Token budgets count prompt + completion tokens (cached ones
    included: providers bill them, at a discount that `cost_usd` carries)."""

    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    cached_tokens: int = 0  # of prompt_tokens, read from the upstream's cache
    compute_ms: float = 0.0  # the upstream's own time, where it reports it

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class WindowUsage:
    period: str  # "day" | "month"
    start: str  # ISO date of the window's first day (UTC)
    upstream_prompt_tokens: int
    upstream_completion_tokens: int
    upstream_cost_usd: float
    requests: int
    upstream_cached_tokens: int = 0
    upstream_compute_ms: int = 0


@dataclass(frozen=True)
class Headroom:
    """What the tenant can still spend, reservations of others subtracted; None: unlimited."""

    tokens: int | None
    cost_usd: float | None

    @property
    def exhausted(self) -> bool:
        return (self.tokens is not None and self.tokens <= 0) or (self.cost_usd is not None and self.cost_usd <= 0)


SETTLED_MEMORY_S = 2 * 86_400  # how long a settled reservation id is remembered (retries come in seconds)


def windows_of(now: float) -> list[tuple[str, str, int]]:
    """(period, window start as ISO date, seconds until the window ends) for each budget window."""
    moment = datetime.fromtimestamp(now, timezone.utc)
    day_start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    month_start = day_start.replace(day=1)
    next_month = (month_start.replace(day=28) + timedelta(days=4)).replace(day=1)
    return [
        ("day", day_start.date().isoformat(), math.ceil((day_start + timedelta(days=1)).timestamp() - now)),
        ("month", month_start.date().isoformat(), math.ceil(next_month.timestamp() - now)),
    ]


def to_micro(usd: float, round_up: bool = False) -> int:
    """Micro-dollars: reservations round up (never under-reserve), settlements to nearest."""
    micro = usd * 1_000_000
    return int(math.ceil(micro)) if round_up else int(round(micro))


@dataclass(frozen=True)
class SlotLease:
    """One upstream slot held for one call: `erase` when it may still hold another scope's prompts."""

    slot: int
    erase: bool
    lease: str  # names this holding, so that only its holder releases it


UNKNOWN_SCOPE = "?"  # a slot whose erase failed: whoever takes it next erases it first


def slot_rank(state: dict[str, Any], scope: str, key: str) -> tuple[int, float]:
    """How well a free slot suits a call: the request's own slot, then one of its scope, then an
    unused one, then any other (to be erased); among equals the one idle longest."""
    if state.get("s") == scope:
        return (3 if state.get("k") == key else 2), -state.get("u", 0.0)
    return (1 if not state.get("s") else 0), -state.get("u", 0.0)


def long_lease_limits(count: int) -> tuple[int, int]:
    """For `count` slots: how many must stay free for a long lease to be granted, and how many long
    leases one scope may hold. A whole answer holds its slot for minutes, a hand-off for a fraction
    of a second: without these, two streams of one tenant would hold a two-slot server and every
    other tenant's hand-offs would wait for them."""
    return (1 if count > 1 else 0), max(1, (count - 1) // 2)


def size_of(value: str) -> int:
    """The bytes a kept text takes (UTF-8), as Redis counts them."""
    return len(value.encode())


def new_reservation(tenant: str, tokens: int, cost_usd: float) -> Reservation:
    return Reservation(tenant, uuid.uuid4().hex, tokens, to_micro(cost_usd, round_up=True))


# -- the tenant directory: tenants and their keys, shared by every replica --

AUDIT_MAX_ENTRIES = 10_000  # the audit log keeps this many of the latest changes


@dataclass(frozen=True)
class DirectoryWrite:
    """One field of the tenant directory (`table` "tenants" or "keys", field `name`), set to `value`
    (None: deleted) only if it holds `expected` now (None: whatever it holds; "": nothing)."""

    table: str
    name: str
    value: str | None
    expected: str | None = None


@dataclass(frozen=True)
class DirectoryVersion:
    """Which directory the Store holds and which change of it. `epoch` is a random id the Store keeps
    beside the records and makes anew when it has none (a Redis that restarted empty); `number` is
    bumped by every write (0 before the first). Equal versions: the same records."""

    epoch: str
    number: int


@dataclass(frozen=True)
class DirectoryRecords:
    """Every tenant and key record (opaque JSON texts, by tenant id and key id) as of `version`."""

    version: DirectoryVersion
    tenants: dict[str, str]
    keys: dict[str, str]


class Store(Protocol):
    """Every method may raise StoreUnavailable; none blocks longer than the store's time-out."""

    async def reserve(self, reservation: Reservation, limits: Limits, now: float, ttl_s: float = 0.0) -> bool:
        """Hold the reservation's tokens and cost against its tenant's windows; False if a limit would pass.

        The hold lasts max(`ttl_s`, the store's reservation TTL) unless settled or released."""

    async def settle(self, reservation: Reservation, billed: Billed, now: float) -> None:
        """Replace the reservation by what was billed, atomically and at most once per id."""

    async def release(self, reservation: Reservation) -> None:
        """Drop a reservation that was not spent."""

    async def headroom(self, tenant: str, limits: Limits, now: float) -> Headroom: ...

    async def count_request(self, tenant: str, now: float) -> None: ...

    async def usage(self, tenant: str, now: float) -> list[WindowUsage]: ...

    async def admit(self, tenant: str, request_id: str, limits: RateLimits, tokens: int, now: float) -> float | None:
        """Count a request of `tokens` against the limits; None if admitted, else seconds to wait.

        A refused request does not count. An admitted one holds a parallel slot until `release_slot`."""

    async def admit_tokens(self, tenant: str, tokens: int, limit: int, now: float) -> float | None:
        """Count `tokens` (an admitted request's prompt and answers, once its prompt is tokenized)
        against `limit` tokens this minute; None if they fit, else seconds to wait (and nothing counts)."""

    async def release_slot(self, tenant: str, request_id: str) -> None: ...

    async def cache_get(self, key: str) -> str | None: ...

    async def cache_put(self, key: str, value: str) -> None:
        """Keep `value` for the cache TTL; the least recently written entries go past the size cap.
        Raises StoreFull (nothing written) while the store is near full."""

    async def response_put(self, tenant: str, response_id: str, value: str, ttl_s: float,
                           quota: ResponseQuota | None = None) -> None:
        """Keep a stored Responses API response of `tenant`'s for `ttl_s` seconds. Raises StoreFull
        (nothing written) if the tenant's live stored responses and this one would pass `quota`
        (None: no quota), or while the store is near full."""

    async def response_get(self, tenant: str, response_id: str) -> str | None:
        """`tenant`'s stored response, or None (unknown, expired, deleted, or another tenant's)."""

    async def response_delete(self, tenant: str, response_id: str) -> bool:
        """Forget `tenant`'s stored response; False if there was none."""

    async def slot_lease(self, server: str, count: int, scope: str, key: str, ttl_s: float,
                         lease: str = "", long: bool = False) -> SlotLease | None:
        """Hold the free slot of `server`'s `count` that best suits a call in cache `scope` (see
        `slot_rank`) for at most `ttl_s`, recording `scope` as its holder, under the id `lease`
        (a new one if empty); None while all are held. A `long` lease (a whole answer streamed
        through) gets a slot only within `long_lease_limits`. Every gateway process sharing the
        store hands out the same slots."""

    async def slot_release(self, server: str, lease: SlotLease, erased: bool = True) -> None:
        """Free a held slot; `erased=False` after a failed erase (its next holder erases it).
        `lease.slot` -1: whichever slot that lease id holds (a lease whose reply was lost)."""

    async def quality_add(self, alias: str, counts: Mapping[str, float], bucket: int | None = None,
                          bucket_counts: Mapping[str, float] | None = None, bucket_ttl_s: float = 0.0) -> None:
        """Add `counts` to the alias's shadow-answer counters, and `bucket_counts` to its time bucket
        `bucket` (kept for `bucket_ttl_s`), in one step: every replica's samples pool here. Counts
        only: no text is ever written."""

    async def quality_read(self, alias: str, buckets: Sequence[int] = ()) -> tuple[dict[str, float],
                                                                                 list[dict[str, float]]]:
        """The alias's shadow counters, and each of `buckets`' ({} where it has none)."""

    async def knob_window(self, knob: str, agreed: bool, size: int) -> tuple[int, int] | None:
        """Count one shadow sample into the knob's window, pooled over replicas; the call that fills
        it to `size` empties it and gets its (samples, agreed): exactly one caller per window."""

    async def knob_move(self, knob: str, initial: float, delta: float, floor: float,
                        ceiling: float) -> tuple[float, float]:
        """Move the knob (at `initial` until first moved) by `delta`, never past floor..ceiling;
        (before, after)."""

    async def knob_read(self, knob: str) -> float | None:
        """The knob's value, None until first moved."""

    async def directory_write(self, writes: Sequence[DirectoryWrite], audit: str) -> bool:
        """Apply every write, bump the directory's version and append `audit` to the audit log, all in
        one step; or, if any write's `expected` does not hold, nothing at all (False)."""

    async def directory_version(self) -> DirectoryVersion:
        """The directory's version: its number changes with every write, its epoch when the Store
        lost the directory."""

    async def directory_read(self) -> DirectoryRecords:
        """Every tenant and key record, read in one step."""

    async def audit_read(self, limit: int) -> list[str]:
        """The latest `limit` audit entries (at most AUDIT_MAX_ENTRIES kept), newest first."""

    async def examples_add(self, key: str, example: str, tenant: str, share: float | None, keep: int) -> bool:
        """Append one learning example (JSON text, no prompt or answer text) to the list `key` (an
        alias and local model's), keeping its newest `keep`; refused (False) when `share` is given and
        `tenant` has already given ceil(share * (examples ever added + 1)) of them. One step: replicas
        pool here."""

    async def examples_read(self, key: str) -> tuple[list[str], int]:
        """The examples kept under `key`, oldest first, and how many were ever added."""

    async def learned_read(self, key: str) -> str | None:
        """The learned check promoted under `key` (JSON text), None if none."""

    async def learned_swap(self, key: str, value: str, expected: str | None) -> bool:
        """Put `value` under `key` if what it holds is `expected` (None: nothing); whether it did:
        of two replicas promoting at once, one wins and the other reads the winner."""

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
