"""MemoryStore: the embedded default Store (adapters/store.py has the seam's contract), in one process."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from adapters.store import (
    AUDIT_MAX_ENTRIES,
    SETTLED_MEMORY_S,
    UNKNOWN_SCOPE,
    Billed,
    DirectoryRecords,
    DirectoryVersion,
    DirectoryWrite,
    Headroom,
    Limits,
    RateLimits,
    Reservation,
    ResponseQuota,
    SlotLease,
    StoreFull,
    WindowUsage,
    long_lease_limits,
    size_of,
    slot_rank,
    to_micro,
    windows_of,
)


@dataclass
class _Window:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_micro: int = 0
    requests: int = 0
    cached_tokens: int = 0
    compute_ms: int = 0


@dataclass
class MemoryStore:
    """The embedded default: the same semantics as RedisStore, in one process."""

    reservation_ttl_s: float = 60.0
    cache_ttl_s: float = 86_400.0
    cache_max_entries: int = 10_000
    responses_max_entries: int = 10_000
    max_bytes: int = 256_000_000  # stored responses and cached continuations together: past it, neither is written
    _windows: dict[tuple[str, str, str], _Window] = field(default_factory=dict)
    _held: dict[str, dict[str, tuple[Reservation, float]]] = field(default_factory=dict)
    _minute: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # (requests, tokens)
    _parallel: dict[str, dict[str, float]] = field(default_factory=dict)
    _cache: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)
    _settled: OrderedDict[str, float] = field(default_factory=OrderedDict)  # reservation id -> when to forget it
    _responses: OrderedDict[tuple[str, str], tuple[str, float]] = field(default_factory=OrderedDict)
    _tenant_responses: dict[str, tuple[int, int]] = field(default_factory=dict)  # tenant -> (count, bytes)
    _kept_bytes: int = 0  # of stored responses and cached continuations
    _slots: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # server -> slot -> state
    _quality: dict[str, dict[str, float]] = field(default_factory=dict)  # alias -> shadow counters
    _quality_buckets: dict[tuple[str, int], tuple[dict[str, float], float]] = field(default_factory=dict)
    _knobs: dict[str, dict[str, float]] = field(default_factory=dict)  # knob -> value, window counts
    # learning examples: key -> (the newest, counts added: "" all, else by tenant); promoted checks
    _examples: dict[str, tuple[list[str], dict[str, int]]] = field(default_factory=dict)
    _learned: dict[str, str] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _directory: dict[str, dict[str, str]] = field(default_factory=lambda: {"tenants": {}, "keys": {}})
    _directory_version: int = 0
    _directory_epoch: str = field(default_factory=lambda: uuid.uuid4().hex)  # an in-process store never restarts
    _audit: list[str] = field(default_factory=list)  # newest last

    def _window(self, tenant: str, period: str, start: str) -> _Window:
        return self._windows.setdefault((tenant, period, start), _Window())

    def _live(self, tenant: str, now: float) -> list[Reservation]:
        held = self._held.setdefault(tenant, {})
        for key in [k for k, (_, expires) in held.items() if expires <= now]:
            del held[key]
        return [r for r, _ in held.values()]

    def _headroom(self, tenant: str, limits: Limits, now: float) -> Headroom:
        live = self._live(tenant, now)
        held_tokens = sum(r.tokens for r in live)
        held_cost = sum(r.cost_micro for r in live)
        token_room: list[int] = []
        cost_room: list[int] = []
        for period, start, _ in windows_of(now):
            window = self._window(tenant, period, start)
            tok_limit = limits.day_tokens if period == "day" else limits.month_tokens
            cost_limit = limits.day_cost_usd if period == "day" else limits.month_cost_usd
            if tok_limit is not None:
                token_room.append(tok_limit - window.prompt_tokens - window.completion_tokens - held_tokens)
            if cost_limit is not None:
                cost_room.append(to_micro(cost_limit) - window.cost_micro - held_cost)
        return Headroom(min(token_room) if token_room else None,
                        min(cost_room) / 1e6 if cost_room else None)

    async def reserve(self, reservation: Reservation, limits: Limits, now: float, ttl_s: float = 0.0) -> bool:
        async with self._lock:
            room = self._headroom(reservation.tenant, limits, now)
            if (room.tokens is not None and reservation.tokens > room.tokens) or (
                room.cost_usd is not None and reservation.cost_micro > to_micro(room.cost_usd)
            ):
                return False
            self._held[reservation.tenant][reservation.id] = (reservation, now + max(ttl_s, self.reservation_ttl_s))
            return True

    async def settle(self, reservation: Reservation, billed: Billed, now: float) -> None:
        async with self._lock:
            self._held.get(reservation.tenant, {}).pop(reservation.id, None)
            while self._settled and next(iter(self._settled.values())) <= now:  # oldest first
                self._settled.popitem(last=False)
            if reservation.id in self._settled:
                return
            self._settled[reservation.id] = now + SETTLED_MEMORY_S
            for period, start, _ in windows_of(now):
                window = self._window(reservation.tenant, period, start)
                window.prompt_tokens += billed.prompt_tokens
                window.completion_tokens += billed.completion_tokens
                window.cost_micro += to_micro(billed.cost_usd)
                window.cached_tokens += billed.cached_tokens
                window.compute_ms += round(billed.compute_ms)

    async def release(self, reservation: Reservation) -> None:
        self._held.get(reservation.tenant, {}).pop(reservation.id, None)

    async def headroom(self, tenant: str, limits: Limits, now: float) -> Headroom:
        return self._headroom(tenant, limits, now)

    async def count_request(self, tenant: str, now: float) -> None:
        for period, start, _ in windows_of(now):
            self._window(tenant, period, start).requests += 1

    async def usage(self, tenant: str, now: float) -> list[WindowUsage]:
        result = []
        for period, start, _ in windows_of(now):
            w = self._windows.get((tenant, period, start), _Window())
            result.append(WindowUsage(period, start, w.prompt_tokens, w.completion_tokens, w.cost_micro / 1e6,
                                      w.requests, w.cached_tokens, w.compute_ms))
        return result

    async def admit(self, tenant: str, request_id: str, limits: RateLimits, tokens: int, now: float) -> float | None:
        minute = int(now // 60)
        for stale in [k for k in self._minute if k[1] < minute]:
            del self._minute[stale]
        requests, used = self._minute.get((tenant, minute), (0, 0))
        if (limits.requests_per_minute is not None and requests + 1 > limits.requests_per_minute) or (
            limits.tokens_per_minute is not None and used + tokens > limits.tokens_per_minute
        ):
            return (minute + 1) * 60 - now
        if limits.max_parallel is not None:
            running = self._parallel.setdefault(tenant, {})
            for key in [k for k, expires in running.items() if expires <= now]:
                del running[key]
            if len(running) >= limits.max_parallel:
                return 1.0
            running[request_id] = now + self.reservation_ttl_s * 10
        self._minute[(tenant, minute)] = (requests + 1, used + tokens)
        return None

    async def admit_tokens(self, tenant: str, tokens: int, limit: int, now: float) -> float | None:
        minute = int(now // 60)
        requests, used = self._minute.get((tenant, minute), (0, 0))
        if used + tokens > limit:
            return (minute + 1) * 60 - now
        self._minute[(tenant, minute)] = (requests, used + tokens)
        return None

    async def release_slot(self, tenant: str, request_id: str) -> None:
        self._parallel.get(tenant, {}).pop(request_id, None)

    async def cache_get(self, key: str) -> str | None:
        hit = self._cache.get(key)
        if hit is None or hit[1] <= time.time():
            return None
        return hit[0]

    async def cache_put(self, key: str, value: str) -> None:
        self._forget_cached(key)
        self._make_room(size_of(value))
        self._cache[key] = (value, time.time() + self.cache_ttl_s)
        self._kept_bytes += size_of(value)
        while len(self._cache) > self.cache_max_entries:
            self._forget_cached(next(iter(self._cache)))

    async def response_put(self, tenant: str, response_id: str, value: str, ttl_s: float,
                           quota: ResponseQuota | None = None) -> None:
        now, size = time.time(), size_of(value)
        self._forget_response((tenant, response_id))
        self._forget_expired_responses(now, oldest_only=True)
        if not self._within(quota, tenant, size):
            self._forget_expired_responses(now)  # before refusing, every expired one whatever its TTL
            if not self._within(quota, tenant, size):
                raise StoreFull(f"tenant '{tenant}' is at its quota of stored responses ({quota})")
        self._make_room(size)
        self._responses[(tenant, response_id)] = (value, now + ttl_s)
        count, held = self._tenant_responses.get(tenant, (0, 0))
        self._tenant_responses[tenant] = (count + 1, held + size)
        self._kept_bytes += size
        while len(self._responses) > self.responses_max_entries:  # one process's memory: the oldest go
            self._forget_response(next(iter(self._responses)))

    async def response_get(self, tenant: str, response_id: str) -> str | None:
        hit = self._responses.get((tenant, response_id))
        return hit[0] if hit is not None and hit[1] > time.time() else None

    async def response_delete(self, tenant: str, response_id: str) -> bool:
        hit = self._forget_response((tenant, response_id))
        return hit is not None and hit[1] > time.time()

    def _make_room(self, size: int) -> None:
        if self._kept_bytes + size > self.max_bytes:
            raise StoreFull(f"the in-process store is near full ({self._kept_bytes} of {self.max_bytes} bytes kept)")

    def _forget_cached(self, key: str) -> None:
        hit = self._cache.pop(key, None)
        if hit is not None:
            self._kept_bytes -= size_of(hit[0])

    def _forget_response(self, key: tuple[str, str]) -> tuple[str, float] | None:
        hit = self._responses.pop(key, None)
        if hit is not None:
            size = size_of(hit[0])
            count, held = self._tenant_responses.pop(key[0])
            if count > 1:
                self._tenant_responses[key[0]] = (count - 1, held - size)
            self._kept_bytes -= size
        return hit

    def _within(self, quota: ResponseQuota | None, tenant: str, size: int) -> bool:
        count, held = self._tenant_responses.get(tenant, (0, 0))
        return quota is None or (count + 1 <= quota.count and held + size <= quota.bytes)

    def _forget_expired_responses(self, now: float, oldest_only: bool = False) -> None:
        """Forget expired responses: all, or (cheap) the run of them at the oldest end, which is all
        of them when every response has the same TTL."""
        expired = []
        for key, (_, expires) in self._responses.items():
            if expires <= now:
                expired.append(key)
            elif oldest_only:
                break
        for key in expired:
            self._forget_response(key)

    async def slot_lease(self, server: str, count: int, scope: str, key: str, ttl_s: float,
                         lease: str = "", long: bool = False) -> SlotLease | None:
        now = time.time()
        states = self._slots.setdefault(server, {})
        free = [i for i in range(count) if states.get(i, {}).get("b", 0.0) <= now]
        if long:
            keep_free, per_scope = long_lease_limits(count)
            held_long = sum(1 for i in range(count) if i not in free and states[i].get("t") and states[i]["s"] == scope)
            if len(free) <= keep_free or held_long >= per_scope:
                return None
        if not free:
            return None
        slot = max(free, key=lambda i: slot_rank(states.get(i, {}), scope, key))
        before = states.get(slot, {}).get("s")
        held = SlotLease(slot, bool(before) and before != scope, lease or uuid.uuid4().hex)
        states[slot] = {"s": scope, "k": key, "u": now, "b": now + ttl_s, "l": held.lease, "t": int(long)}
        return held

    async def slot_release(self, server: str, lease: SlotLease, erased: bool = True) -> None:
        states = self._slots.get(server, {})
        for slot in states if lease.slot == -1 else [lease.slot]:
            state = states.get(slot)
            if state is not None and state["l"] == lease.lease:
                state.update(b=0.0, s=state["s"] if erased else UNKNOWN_SCOPE)

    async def quality_add(self, alias: str, counts: Mapping[str, float], bucket: int | None = None,
                          bucket_counts: Mapping[str, float] | None = None, bucket_ttl_s: float = 0.0) -> None:
        _add(self._quality.setdefault(alias, {}), counts)
        if bucket is None or not bucket_counts:
            return
        now = time.time()
        if (alias, bucket) not in self._quality_buckets:  # a new bucket: drop the expired ones first
            for key in [k for k, (_, expires) in self._quality_buckets.items() if expires <= now]:
                del self._quality_buckets[key]
        held, _ = self._quality_buckets.get((alias, bucket), ({}, 0.0))
        self._quality_buckets[(alias, bucket)] = (_add(held, bucket_counts), now + bucket_ttl_s)

    async def quality_read(self, alias: str, buckets: Sequence[int] = ()) -> tuple[dict[str, float],
                                                                                 list[dict[str, float]]]:
        now = time.time()
        found = [self._quality_buckets.get((alias, bucket), ({}, 0.0)) for bucket in buckets]
        return dict(self._quality.get(alias, {})), [dict(counts) if expires > now else {} for counts, expires in found]

    async def knob_window(self, knob: str, agreed: bool, size: int) -> tuple[int, int] | None:
        state = self._knobs.setdefault(knob, {})
        _add(state, {"n": 1, "a": int(agreed)})
        if state["n"] < size:
            return None
        window = (int(state["n"]), int(state["a"]))
        state.update(n=0, a=0)
        return window

    async def knob_move(self, knob: str, initial: float, delta: float, floor: float,
                        ceiling: float) -> tuple[float, float]:
        state = self._knobs.setdefault(knob, {})
        before = state.get("value", initial)
        state["value"] = min(ceiling, max(floor, before + delta))
        return before, state["value"]

    async def knob_read(self, knob: str) -> float | None:
        return self._knobs.get(knob, {}).get("value")

    async def directory_write(self, writes: Sequence[DirectoryWrite], audit: str) -> bool:
        for write in writes:
            held = self._directory[write.table].get(write.name, "")
            if write.expected is not None and held != write.expected:
                return False
        for write in writes:
            if write.value is None:
                self._directory[write.table].pop(write.name, None)
            else:
                self._directory[write.table][write.name] = write.value
        self._audit.append(audit)
        del self._audit[:-AUDIT_MAX_ENTRIES]
        self._directory_version += 1
        return True

    async def directory_version(self) -> DirectoryVersion:
        return DirectoryVersion(self._directory_epoch, self._directory_version)

    async def directory_read(self) -> DirectoryRecords:
        return DirectoryRecords(await self.directory_version(), dict(self._directory["tenants"]),
                                dict(self._directory["keys"]))

    async def audit_read(self, limit: int) -> list[str]:
        return self._audit[::-1][:limit]

    async def examples_add(self, key: str, example: str, tenant: str, share: float | None, keep: int) -> bool:
        kept, counts = self._examples.setdefault(key, ([], {}))
        total = counts.get("", 0)
        if share is not None and counts.get(tenant, 0) >= math.ceil(share * (total + 1)):
            return False
        kept.append(example)
        del kept[:-keep]
        counts[""], counts[tenant] = total + 1, counts.get(tenant, 0) + 1
        return True

    async def examples_read(self, key: str) -> tuple[list[str], int]:
        kept, counts = self._examples.get(key, ([], {}))
        return list(kept), counts.get("", 0)

    async def learned_read(self, key: str) -> str | None:
        return self._learned.get(key)

    async def learned_swap(self, key: str, value: str, expected: str | None) -> bool:
        if self._learned.get(key) != expected:
            return False
        self._learned[key] = value
        return True

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None


def _add(into: dict[str, float], counts: Mapping[str, float]) -> dict[str, float]:
    for key, value in counts.items():
        into[key] = into.get(key, 0.0) + value
    return into
