"""RedisStore: the Store seam over Redis, shared by every gateway process and replica.

Keys (all under one prefix, all with TTLs so nothing needs sweeping; TTLs are relative, so a
caller's clock that differs from Redis's never expires a key early). Each tenant's keys carry the
tenant as their hash tag, so one Redis Cluster slot holds them all:
  {p}:{tenant}:win:{period}:{start}   hash: prompt_tokens, completion_tokens, cost_micro, requests,
                                      cached_tokens, compute_ms
  {p}:{tenant}:held                   zset of live reservations "id|tokens|cost_micro", score = expiry
  {p}:{tenant}:rate:{minute}          hash: requests, tokens admitted in one minute
  {p}:{tenant}:par                    zset of requests in flight, score = expiry
  {p}:{tenant}:settled:{reservation}  marks a settled reservation, so a retried settle bills nothing
  {p}:{tenant}:resp:{response id}     a stored Responses API response (JSON), for its own TTL
  {p}:{tenant}:resps                  zset of the tenant's stored response ids, score = expiry
  {p}:{tenant}:resp-bytes             hash: response id -> bytes, and "" -> their total (the quota)
  {p}:{cache:}:entry:{key}            cached upstream continuations, indexed by write time in
  {p}:{cache:}:index                  zset of cache keys; the oldest go past `cache_max_entries`
  {p}:{slots:<server>}:state          hash: an upstream server's slot -> JSON {scope, key, used,
                                      held until, lease id} (slot leases, shared by every replica)
  {p}:{quality:}:totals:{alias}       hash: shadow-answer counters (gateway/shadow/figures.py), counts only
  {p}:{quality:}:bucket:{alias}:{n}   hash: samples, agreed in time bucket n, for the timeline's TTL
  {p}:{quality:}:knob:{knob}          hash: a quality target's knob value, moves, its window (n, a)
  {p}:{quality:}:examples:{key}      list: learning examples of an alias and local model (JSON: features,
                                      label, lengths; never text), the newest `keep`
  {p}:{quality:}:example_counts:{key} hash: examples ever added, in all (total) and by tenant (t:{id})
  {p}:{quality:}:learned:{key}        string: the promoted learned answer check (JSON)
  {p}:{tenants:}:tenants              hash: tenant id -> its settings (JSON); the tenant directory,
  {p}:{tenants:}:keys                 hash: key id -> its record (JSON: tenant, name, SHA-256 digest,
                                      expiry, scopes; never the key), both with no TTL
  {p}:{tenants:}:version              counter: bumped by every directory change (replicas poll it)
  {p}:{tenants:}:epoch                a random id, set when missing: a new one means Redis lost the directory
  {p}:{tenants:}:audit                list: the latest directory changes (JSON), newest first
Reservations are taken by a Lua script (adapters/redis_scripts.py), so concurrent requests in any
number of processes cannot together pass a limit; settlement is another script, exactly-once per
reservation id.

Calls run on a small thread pool with blocking sockets, so a time-out measures Redis (and the
network), not the event loop: a busy loop that reads a reply late must not make the store look
down. After three failures in a row the store reports itself unavailable for a second instead of
costing a time-out on every call. Above `max_memory_fraction` of Redis's maxmemory, stored
responses and cached continuations are not written (StoreFull), so that a Redis that refuses writes
when full (`noeviction`) still has room for budgets and rate limits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisError
from redis.retry import Retry

from adapters.redis_directory import RedisDirectory
from adapters.redis_scripts import (
    ADMIT_LUA,
    ADMIT_TOKENS_LUA,
    CACHE_PUT_LUA,
    DIRECTORY_WRITE_LUA,
    EXAMPLES_ADD_LUA,
    HEADROOM_LUA,
    KNOB_MOVE_LUA,
    KNOB_WINDOW_LUA,
    LEARNED_SWAP_LUA,
    RESPONSE_DELETE_LUA,
    RESPONSE_PUT_LUA,
    SETTLE_LUA,
    SLOT_LEASE_LUA,
    SLOT_RELEASE_LUA,
)
from adapters.store import (
    SETTLED_MEMORY_S,
    Billed,
    Headroom,
    Limits,
    RateLimits,
    Reservation,
    ResponseQuota,
    SlotLease,
    StoreFull,
    StoreSkipped,
    StoreUnavailable,
    WindowUsage,
    long_lease_limits,
    to_micro,
    windows_of,
)

UNLIMITED = -1  # a limit the scripts read as none
# The continuation cache is one bounded set (entries and their index, which its script trims
# together): one hash tag keeps it in one Cluster slot. Tenant ids cannot contain ":" (settings).
CACHE_TAG = "cache:"
QUALITY_TAG = "quality:"  # every shadow counter and knob in one Cluster slot: one pipeline writes them
T = TypeVar("T")
log = logging.getLogger("gateway.store")
FAILURES_BEFORE_SKIP = 3  # one slow reply must not turn a whole burst of requests local-only
SKIP_S = 1.0  # then calls fail at once for this long instead of each waiting for its time-out
MEMORY_READ_S = 1.0  # how long one reading of INFO memory stands
NO_QUOTA = ResponseQuota(2**53, 2**53)  # a Lua number holds integers exactly up to 2^53


class RedisStore(RedisDirectory):
    """Store over one Redis; every method raises StoreUnavailable when Redis does not answer."""

    def __init__(self, url: str, prefix: str, timeout_s: float, reservation_ttl_s: float, cache_ttl_s: float,
                 cache_max_entries: int = 10_000, threads: int = 4, cluster: bool = False,
                 max_memory_fraction: float = 0.8) -> None:
        options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                       decode_responses=True, max_connections=threads)
        self._redis = RedisCluster.from_url(url, **options) if cluster else redis.Redis.from_url(url, **options)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="redis")
        self._prefix = prefix
        self._reservation_ttl_s = reservation_ttl_s
        self._cache_ttl_s = cache_ttl_s
        self._cache_max_entries = cache_max_entries
        self._headroom_script = self._redis.register_script(HEADROOM_LUA)
        self._admit_script = self._redis.register_script(ADMIT_LUA)
        self._admit_tokens_script = self._redis.register_script(ADMIT_TOKENS_LUA)
        self._settle_script = self._redis.register_script(SETTLE_LUA)
        self._cache_put_script = self._redis.register_script(CACHE_PUT_LUA)
        self._slot_lease_script = self._redis.register_script(SLOT_LEASE_LUA)
        self._slot_release_script = self._redis.register_script(SLOT_RELEASE_LUA)
        self._response_put_script = self._redis.register_script(RESPONSE_PUT_LUA)
        self._response_delete_script = self._redis.register_script(RESPONSE_DELETE_LUA)
        self._knob_window_script = self._redis.register_script(KNOB_WINDOW_LUA)
        self._knob_move_script = self._redis.register_script(KNOB_MOVE_LUA)
        self._examples_add_script = self._redis.register_script(EXAMPLES_ADD_LUA)
        self._learned_swap_script = self._redis.register_script(LEARNED_SWAP_LUA)
        self._directory_write_script = self._redis.register_script(DIRECTORY_WRITE_LUA)
        self._failures = 0  # consecutive; only touched on the event loop
        self._skip_until = 0.0
        self._cluster = cluster
        self._max_memory_fraction = max_memory_fraction
        self._memory = (-MEMORY_READ_S, 0.0)  # (when read, monotonic; share of maxmemory used)

    async def _run(self, call: Callable[[], T]) -> T:
        """Run one blocking Redis call on the pool; any failure becomes StoreUnavailable."""
        if time.monotonic() < self._skip_until:
            raise StoreSkipped("Redis failed repeatedly; retrying shortly")
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except (RedisError, OSError) as exc:
            self._failures += 1
            if self._failures >= FAILURES_BEFORE_SKIP:
                if self._failures == FAILURES_BEFORE_SKIP:
                    log.warning("Redis unavailable (%s); serving local-only until it answers", type(exc).__name__)
                self._skip_until = time.monotonic() + SKIP_S
            raise StoreUnavailable(f"Redis unavailable: {type(exc).__name__}: {exc}") from exc
        if self._failures >= FAILURES_BEFORE_SKIP:
            log.warning("Redis answers again")
        self._failures = 0
        return result

    def _key(self, tenant: str, *parts: object) -> str:
        """A key of `tenant`'s: every one carries the tenant as its hash tag, so that all of a tenant's
        keys live in one Redis Cluster slot and one script may touch them together."""
        return ":".join((self._prefix, f"{{{tenant}}}", *map(str, parts)))

    def _window_keys(self, tenant: str, now: float) -> list[tuple[str, int]]:
        return [(self._key(tenant, "win", period, start), ttl) for period, start, ttl in windows_of(now)]

    async def _headroom_call(self, tenant: str, limits: Limits, now: float, reservation: Reservation | None,
                             ttl_s: float = 0.0) -> list[int]:
        (day, _), (month, _) = self._window_keys(tenant, now)
        args = [
            now, now + max(ttl_s, self._reservation_ttl_s), _member(reservation) if reservation else "",
            reservation.tokens if reservation else 0, reservation.cost_micro if reservation else 0,
            _limit(limits.day_tokens), _limit_micro(limits.day_cost_usd),
            _limit(limits.month_tokens), _limit_micro(limits.month_cost_usd),
            1 if reservation else 0,
        ]
        keys = [self._key(tenant, "held"), day, month]
        return await self._run(lambda: self._headroom_script(keys=keys, args=args))

    async def reserve(self, reservation: Reservation, limits: Limits, now: float, ttl_s: float = 0.0) -> bool:
        ok, _, _ = await self._headroom_call(reservation.tenant, limits, now, reservation, ttl_s)
        return ok == 1

    async def headroom(self, tenant: str, limits: Limits, now: float) -> Headroom:
        _, tokens, cost = await self._headroom_call(tenant, limits, now, None)
        has_tokens = limits.day_tokens is not None or limits.month_tokens is not None
        has_cost = limits.day_cost_usd is not None or limits.month_cost_usd is not None
        return Headroom(tokens if has_tokens else None, cost / 1e6 if has_cost else None)

    async def settle(self, reservation: Reservation, billed: Billed, now: float) -> None:
        (day, day_ttl), (month, month_ttl) = self._window_keys(reservation.tenant, now)
        keys = [self._key(reservation.tenant, "settled", reservation.id), self._key(reservation.tenant, "held"), day,
                month]
        args = [_member(reservation), billed.prompt_tokens, billed.completion_tokens, to_micro(billed.cost_usd),
                day_ttl + 86_400, month_ttl + 86_400, SETTLED_MEMORY_S, billed.cached_tokens, round(billed.compute_ms)]
        await self._run(lambda: self._settle_script(keys=keys, args=args))

    async def release(self, reservation: Reservation) -> None:
        key = self._key(reservation.tenant, "held")
        await self._run(lambda: self._redis.zrem(key, _member(reservation)))

    async def count_request(self, tenant: str, now: float) -> None:
        def count() -> Any:
            pipe = self._redis.pipeline(transaction=True)
            for key, ttl in self._window_keys(tenant, now):
                pipe.hincrby(key, "requests", 1)
                pipe.expire(key, ttl + 86_400)
            return pipe.execute()

        await self._run(count)

    async def usage(self, tenant: str, now: float) -> list[WindowUsage]:
        def read() -> list[dict[str, str]]:
            pipe = self._redis.pipeline(transaction=False)
            for key, _ in self._window_keys(tenant, now):
                pipe.hgetall(key)
            return pipe.execute()

        rows = await self._run(read)
        return [
            WindowUsage(period, start, int(row.get("prompt_tokens", 0)), int(row.get("completion_tokens", 0)),
                        int(row.get("cost_micro", 0)) / 1e6, int(row.get("requests", 0)),
                        int(row.get("cached_tokens", 0)), int(row.get("compute_ms", 0)))
            for (period, start, _), row in zip(windows_of(now), rows)
        ]

    async def admit(self, tenant: str, request_id: str, limits: RateLimits, tokens: int, now: float) -> float | None:
        if limits == RateLimits():
            return None
        minute = int(now // 60)
        keys = [self._key(tenant, "rate", minute), self._key(tenant, "par")]
        args = [now, now + self._reservation_ttl_s * 10, request_id, _limit(limits.requests_per_minute),
                _limit(limits.tokens_per_minute), _limit(limits.max_parallel), tokens]
        verdict = await self._run(lambda: self._admit_script(keys=keys, args=args))
        if verdict == 1:
            return None
        return (minute + 1) * 60 - now if verdict == 0 else 1.0

    async def admit_tokens(self, tenant: str, tokens: int, limit: int, now: float) -> float | None:
        minute = int(now // 60)
        keys = [self._key(tenant, "rate", minute)]
        admitted = await self._run(lambda: self._admit_tokens_script(keys=keys, args=[tokens, limit]))
        return None if admitted == 1 else (minute + 1) * 60 - now

    async def release_slot(self, tenant: str, request_id: str) -> None:
        await self._run(lambda: self._redis.zrem(self._key(tenant, "par"), request_id))

    async def cache_get(self, key: str) -> str | None:
        return await self._run(lambda: self._redis.get(self._key(CACHE_TAG, "entry", key)))

    async def cache_put(self, key: str, value: str) -> None:
        await self._check_room()
        keys = [self._key(CACHE_TAG, "entry", key), self._key(CACHE_TAG, "index")]
        args = [value, int(self._cache_ttl_s), time.time(), self._cache_max_entries]
        await self._run(lambda: self._cache_put_script(keys=keys, args=args))

    async def response_put(self, tenant: str, response_id: str, value: str, ttl_s: float,
                           quota: ResponseQuota | None = None) -> None:
        await self._check_room()
        quota = quota or NO_QUOTA
        args = [response_id, value, max(1, int(ttl_s)), time.time(), quota.count, quota.bytes]
        keys = self._response_keys(tenant, response_id)
        if not await self._run(lambda: self._response_put_script(keys=keys, args=args)):
            raise StoreFull(f"tenant '{tenant}' is at its quota of stored responses ({quota})")

    async def response_get(self, tenant: str, response_id: str) -> str | None:
        return await self._run(lambda: self._redis.get(self._key(tenant, "resp", response_id)))

    async def response_delete(self, tenant: str, response_id: str) -> bool:
        keys = self._response_keys(tenant, response_id)
        return bool(await self._run(lambda: self._response_delete_script(keys=keys, args=[response_id])))

    def _response_keys(self, tenant: str, response_id: str) -> list[str]:
        return [self._key(tenant, "resp", response_id), self._key(tenant, "resps"), self._key(tenant, "resp-bytes")]

    async def _check_room(self) -> None:
        """Raise StoreFull while Redis uses more than `max_memory_fraction` of its maxmemory (no
        maxmemory: never). INFO memory is read at most once a second."""
        read_at, used = self._memory
        if time.monotonic() - read_at >= MEMORY_READ_S:
            target = {"target_nodes": RedisCluster.PRIMARIES} if self._cluster else {}
            info = await self._run(lambda: self._redis.info("memory", **target))
            used = max(map(_memory_share, [info] if "used_memory" in info else info.values()))  # a node each
            self._memory = (time.monotonic(), used)
        if used > self._max_memory_fraction:
            raise StoreFull(f"Redis is near full ({used:.0%} of maxmemory used; stored responses and cached "
                            f"continuations stop at {self._max_memory_fraction:.0%})")

    async def slot_lease(self, server: str, count: int, scope: str, key: str, ttl_s: float,
                         lease: str = "", long: bool = False) -> SlotLease | None:
        lease = lease or uuid.uuid4().hex
        keys = [self._key(f"slots:{server}", "state")]
        args = [count, scope, key, time.time(), ttl_s, lease, int(long), *long_lease_limits(count)]
        held = await self._run(lambda: self._slot_lease_script(keys=keys, args=args))
        if held is None:
            return None
        slot, before = int(held[0]), held[1]
        return SlotLease(slot, bool(before) and before != scope, lease)

    async def slot_release(self, server: str, lease: SlotLease, erased: bool = True) -> None:
        keys, args = [self._key(f"slots:{server}", "state")], [lease.slot, lease.lease, int(erased)]
        await self._run(lambda: self._slot_release_script(keys=keys, args=args))

    async def quality_add(self, alias: str, counts: Mapping[str, float], bucket: int | None = None,
                          bucket_counts: Mapping[str, float] | None = None, bucket_ttl_s: float = 0.0) -> None:
        def add() -> Any:
            pipe = self._redis.pipeline(transaction=True)
            totals = self._key(QUALITY_TAG, "totals", alias)
            for name, value in counts.items():
                pipe.hincrbyfloat(totals, name, value)
            if bucket is not None and bucket_counts:
                key = self._key(QUALITY_TAG, "bucket", alias, bucket)
                for name, value in bucket_counts.items():
                    pipe.hincrbyfloat(key, name, value)
                pipe.expire(key, max(1, int(bucket_ttl_s)))
            return pipe.execute()

        await self._run(add)

    async def quality_read(self, alias: str, buckets: Sequence[int] = ()) -> tuple[dict[str, float],
                                                                                 list[dict[str, float]]]:
        def read() -> list[dict[str, str]]:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(self._key(QUALITY_TAG, "totals", alias))
            for bucket in buckets:
                pipe.hgetall(self._key(QUALITY_TAG, "bucket", alias, bucket))
            return pipe.execute()

        rows = [{name: float(value) for name, value in row.items()} for row in await self._run(read)]
        return rows[0], rows[1:]

    async def knob_window(self, knob: str, agreed: bool, size: int) -> tuple[int, int] | None:
        keys = [self._key(QUALITY_TAG, "knob", knob)]
        window = await self._run(lambda: self._knob_window_script(keys=keys, args=[int(agreed), size]))
        return None if window is None else (int(window[0]), int(window[1]))

    async def knob_move(self, knob: str, initial: float, delta: float, floor: float,
                        ceiling: float) -> tuple[float, float]:
        keys, args = [self._key(QUALITY_TAG, "knob", knob)], [repr(initial), repr(delta), repr(floor), repr(ceiling)]
        before, after = await self._run(lambda: self._knob_move_script(keys=keys, args=args))
        return float(before), float(after)

    async def knob_read(self, knob: str) -> float | None:
        value = await self._run(lambda: self._redis.hget(self._key(QUALITY_TAG, "knob", knob), "value"))
        return None if value is None else float(value)

    async def examples_add(self, key: str, example: str, tenant: str, share: float | None, keep: int) -> bool:
        keys = [self._key(QUALITY_TAG, "examples", key), self._key(QUALITY_TAG, "example_counts", key)]
        args = [example, tenant, -1 if share is None else repr(share), keep]
        return bool(await self._run(lambda: self._examples_add_script(keys=keys, args=args)))

    async def examples_read(self, key: str) -> tuple[list[str], int]:
        def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.lrange(self._key(QUALITY_TAG, "examples", key), 0, -1)
            pipe.hget(self._key(QUALITY_TAG, "example_counts", key), "total")
            return pipe.execute()

        kept, total = await self._run(read)
        return list(kept), int(total or 0)

    async def learned_read(self, key: str) -> str | None:
        return await self._run(lambda: self._redis.get(self._key(QUALITY_TAG, "learned", key)))

    async def learned_swap(self, key: str, value: str, expected: str | None) -> bool:
        keys, args = [self._key(QUALITY_TAG, "learned", key)], [expected or "", value]
        return bool(await self._run(lambda: self._learned_swap_script(keys=keys, args=args)))

    async def ping(self) -> bool:
        try:
            return bool(await self._run(self._redis.ping))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._redis.close()


def _member(reservation: Reservation) -> str:
    return f"{reservation.id}|{reservation.tokens}|{reservation.cost_micro}"


def _memory_share(info: dict[str, Any]) -> float:
    """The share of its maxmemory one Redis node uses (0 when it has none)."""
    limit = int(info.get("maxmemory", 0))
    return int(info["used_memory"]) / limit if limit else 0.0


def _limit(value: int | None) -> int:
    return UNLIMITED if value is None else value


def _limit_micro(value: float | None) -> int:
    return UNLIMITED if value is None else to_micro(value)
