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
Reservations are taken by a Lua script, so concurrent requests in any number of processes cannot
together pass a limit; settlement is another script, exactly-once per reservation id.

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

from adapters.store import (
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

# Sums live reservations (dropping expired ones) and checks every window; KEYS: held zset,
# day hash, month hash. ARGV: now, expiry, member, tokens, cost, then (token, cost) limits of
# day and month, -1 for none, then a flag: 1 to reserve, 0 only to report the headroom.
HEADROOM_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held_tok, held_cost = 0, 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local _, t, c = string.match(m, '^([^|]*)|([^|]*)|([^|]*)$')
  held_tok = held_tok + tonumber(t)
  held_cost = held_cost + tonumber(c)
end
local room_tok, room_cost = nil, nil
for i = 2, 3 do
  local used = redis.call('HMGET', KEYS[i], 'prompt_tokens', 'completion_tokens', 'cost_micro')
  local tok_lim, cost_lim = tonumber(ARGV[4 + 2 * i - 2]), tonumber(ARGV[5 + 2 * i - 2])
  if tok_lim >= 0 then
    local r = tok_lim - (tonumber(used[1] or 0) + tonumber(used[2] or 0)) - held_tok
    if room_tok == nil or r < room_tok then room_tok = r end
  end
  if cost_lim >= 0 then
    local r = cost_lim - tonumber(used[3] or 0) - held_cost
    if room_cost == nil or r < room_cost then room_cost = r end
  end
end
if ARGV[10] == '1' then
  local tok, cost = tonumber(ARGV[4]), tonumber(ARGV[5])
  if (room_tok ~= nil and tok > room_tok) or (room_cost ~= nil and cost > room_cost) then
    return {0, room_tok or 0, room_cost or 0}
  end
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[1], math.floor((tonumber(ARGV[2]) - tonumber(ARGV[1])) * 1000) + 1000)
end
return {1, room_tok or 0, room_cost or 0}
"""

# Rate limits in one step. KEYS: this minute's hash (requests, tokens), in-flight zset. ARGV: now,
# slot expiry, request id, requests/min, tokens/min, max parallel (-1: none), tokens asked.
# Returns 1 (admitted), 0 (a per-minute limit) or -1 (no parallel slot); refusals count nothing.
ADMIT_LUA = """
local used = redis.call('HMGET', KEYS[1], 'requests', 'tokens')
local requests, tokens = tonumber(used[1] or 0), tonumber(used[2] or 0)
local rpm, tpm, parallel, asked = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if (rpm >= 0 and requests + 1 > rpm) or (tpm >= 0 and tokens + asked > tpm) then return 0 end
if parallel >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
  if redis.call('ZCARD', KEYS[2]) >= parallel then return -1 end
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], math.floor((tonumber(ARGV[2]) - tonumber(ARGV[1])) * 1000))
end
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', asked)
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""

# Tokens per minute, once a request's prompt is tokenized. KEYS: this minute's hash. ARGV: tokens,
# limit. Returns 1 (counted) or 0 (refused, nothing counted).
ADMIT_TOKENS_LUA = """
local used = tonumber(redis.call('HGET', KEYS[1], 'tokens') or 0)
if used + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[1])
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""

# Exactly-once settlement. KEYS: settled marker, held zset, day hash, month hash. ARGV: member,
# prompt tokens, completion tokens, cost, day ttl, month ttl, marker ttl, cached tokens, compute ms.
# Returns 1 if it billed.
SETTLE_LUA = """
redis.call('ZREM', KEYS[2], ARGV[1])
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[7]) then return 0 end
for i = 3, 4 do
  redis.call('HINCRBY', KEYS[i], 'prompt_tokens', ARGV[2])
  redis.call('HINCRBY', KEYS[i], 'completion_tokens', ARGV[3])
  redis.call('HINCRBY', KEYS[i], 'cost_micro', ARGV[4])
  redis.call('HINCRBY', KEYS[i], 'cached_tokens', ARGV[8])
  redis.call('HINCRBY', KEYS[i], 'compute_ms', ARGV[9])
  redis.call('EXPIRE', KEYS[i], ARGV[i + 2])
end
return 1
"""

# Bounded cache write. KEYS: entry, index zset. ARGV: value, ttl s, now, max entries.
CACHE_PUT_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[3]) - tonumber(ARGV[2]))
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if extra > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[2], extra)
  for i = 1, #popped, 2 do redis.call('DEL', popped[i]) end
end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""

# A stored response, within the tenant's quota. KEYS: response, ids zset, sizes hash. ARGV: id,
# value, ttl s, now, most responses, most bytes. Returns 1 if written, 0 if it would pass the quota.
RESPONSE_PUT_LUA = """
local now, ttl, size = tonumber(ARGV[4]), tonumber(ARGV[3]), string.len(ARGV[2])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HINCRBY', KEYS[3], '', -tonumber(redis.call('HGET', KEYS[3], id) or 0))
  redis.call('HDEL', KEYS[3], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = tonumber(redis.call('HGET', KEYS[3], '') or 0)
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) or held + size > tonumber(ARGV[6]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], size)
redis.call('HINCRBY', KEYS[3], '', size)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return 1
"""

# Forget a stored response and its share of the quota. KEYS: as RESPONSE_PUT_LUA. ARGV: id.
RESPONSE_DELETE_LUA = """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], '', -tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or 0))
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

UNLIMITED = -1
# The continuation cache is one bounded set (entries and their index, which its script trims
# together): one hash tag keeps it in one Cluster slot. Tenant ids cannot contain ":" (settings).
# Lease the best free slot of one server (store.slot_rank, the same order). KEYS: the server's
# slots hash (field: slot number, value: JSON state). ARGV: count, scope, key, now, ttl s, lease id.
# ARGV[7..9]: long (1/0), slots a long lease leaves free, long leases a scope may hold
# (store.long_lease_limits). Returns {slot, previous scope} or nil when no slot may be had.
SLOT_LEASE_LUA = """
local best, best_rank, best_used, before = -1, -1, 0, ''
local now, free, held_long = tonumber(ARGV[4]), 0, 0
for i = 0, tonumber(ARGV[1]) - 1 do
  local raw = redis.call('HGET', KEYS[1], i)
  local state = raw and cjson.decode(raw) or {}
  if (state.b or 0) > now and state.t == 1 and state.s == ARGV[2] then held_long = held_long + 1 end
  if (state.b or 0) <= now then
    free = free + 1
    local rank = 0
    if state.s == ARGV[2] then
      rank = (state.k == ARGV[3]) and 3 or 2
    elseif (state.s or '') == '' then
      rank = 1
    end
    local used = state.u or 0
    if rank > best_rank or (rank == best_rank and used < best_used) then
      best, best_rank, best_used, before = i, rank, used, state.s or ''
    end
  end
end
if best < 0 then return nil end
if ARGV[7] == '1' and (free <= tonumber(ARGV[8]) or held_long >= tonumber(ARGV[9])) then return nil end
local state = {s = ARGV[2], k = ARGV[3], u = now, b = now + tonumber(ARGV[5]), l = ARGV[6], t = tonumber(ARGV[7])}
redis.call('HSET', KEYS[1], best, cjson.encode(state))
redis.call('EXPIRE', KEYS[1], 86400)
return {best, before}
"""

# Free a slot if this lease still holds it. KEYS: the slots hash. ARGV: slot (-1: whichever this
# lease holds), lease id, erased (1/0).
SLOT_RELEASE_LUA = """
local fields = {ARGV[1]}
if ARGV[1] == '-1' then fields = redis.call('HKEYS', KEYS[1]) end
for _, field in ipairs(fields) do
  local raw = redis.call('HGET', KEYS[1], field)
  local state = raw and cjson.decode(raw)
  if state and state.l == ARGV[2] then
    state.b = 0
    if ARGV[3] == '0' then state.s = '?' end
    redis.call('HSET', KEYS[1], field, cjson.encode(state))
    return 1
  end
end
return 0
"""

# One shadow sample into a knob's pooled window. KEYS: the knob's hash. ARGV: agreed (0/1), window
# size. Returns {samples, agreed} to the one call that fills the window (and empties it), else nil.
KNOB_WINDOW_LUA = """
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
local a = redis.call('HINCRBY', KEYS[1], 'a', ARGV[1])
if n < tonumber(ARGV[2]) then return nil end
redis.call('HSET', KEYS[1], 'n', 0, 'a', 0)
return {n, a}
"""

# Move a knob within its bounds. KEYS: the knob's hash. ARGV: initial, delta, floor, ceiling.
# Returns {before, after} as strings (a Lua number would come back truncated to an integer).
KNOB_MOVE_LUA = """
local before = tonumber(redis.call('HGET', KEYS[1], 'value') or ARGV[1])
local after = math.min(tonumber(ARGV[4]), math.max(tonumber(ARGV[3]), before + tonumber(ARGV[2])))
redis.call('HSET', KEYS[1], 'value', string.format('%.17g', after))
if after ~= before then redis.call('HINCRBY', KEYS[1], 'moves', 1) end
return {string.format('%.17g', before), string.format('%.17g', after)}
"""

CACHE_TAG = "cache:"
QUALITY_TAG = "quality:"  # every shadow counter and knob in one Cluster slot: one pipeline writes them
SETTLED_MEMORY_S = 2 * 86_400
T = TypeVar("T")
log = logging.getLogger("gateway.store")
FAILURES_BEFORE_SKIP = 3  # one slow reply must not turn a whole burst of requests local-only
SKIP_S = 1.0  # then calls fail at once for this long instead of each waiting for its time-out
MEMORY_READ_S = 1.0  # how long one reading of INFO memory stands
NO_QUOTA = ResponseQuota(2**53, 2**53)  # a Lua number holds integers exactly up to 2^53


class RedisStore:
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
