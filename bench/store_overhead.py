"""Ledger overhead per request: Redis round trips and added latency, memory store vs Redis.

Run: .venv/bin/python -m bench.store_overhead [--url redis://127.0.0.1:6379/0] [--requests 300] [--handoffs 8]

One "request" is what the gateway does with its store: admission (rate limit + request count +
headroom), then per hand-off a reservation and a settlement, and a cache lookup and write. Round
trips are counted from Redis's own `total_commands_processed` (a pipeline of N commands counts N,
so the script also prints the network round trips the code makes by construction).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import redis

from adapters.memory_store import MemoryStore
from adapters.redis_store import RedisStore
from adapters.store import Billed, Limits, RateLimits, new_reservation

LIMITS = Limits(day_tokens=10**12, month_cost_usd=10**6)


async def one_request(store, tenant: str, handoffs: int) -> None:
    now = time.time()
    await store.admit(tenant, uuid.uuid4().hex, RateLimits(requests_per_minute=10**6), 50, now)
    await store.count_request(tenant, now)
    await store.headroom(tenant, LIMITS, now)
    for step in range(handoffs):
        key = f"{tenant}:{uuid.uuid4().hex}:{step}"
        await store.cache_get(key)
        reservation = new_reservation(tenant, 60, 0.0)
        await store.reserve(reservation, LIMITS, now)
        await store.settle(reservation, Billed(55, 1, 0.0), now)
        await store.cache_put(key, "0 text")


async def timed(store, tenant: str, requests: int, handoffs: int) -> list[float]:
    latencies = []
    for _ in range(requests):
        started = time.perf_counter()
        await one_request(store, tenant, handoffs)
        latencies.append(time.perf_counter() - started)
    return latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--handoffs", type=int, default=8)
    args = parser.parse_args()
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    redis_store = RedisStore(args.url, prefix, timeout_s=1.0, reservation_ttl_s=60, cache_ttl_s=60)
    memory_store = MemoryStore()
    counter = redis.Redis.from_url(args.url)
    await timed(redis_store, "warm", 20, args.handoffs)
    before = counter.info("stats")["total_commands_processed"]
    redis_latency = await timed(redis_store, "t", args.requests, args.handoffs)
    commands = counter.info("stats")["total_commands_processed"] - before - 1  # minus the INFO itself
    memory_latency = await timed(memory_store, "t", args.requests, args.handoffs)
    round_trips = 3 + 4 * args.handoffs  # admit, count, headroom; per hand-off get, reserve, settle, put
    print(f"{args.requests} requests with {args.handoffs} hand-offs each, one client, Redis at {args.url}")
    print(f"Redis commands per request : {commands / args.requests:.1f}  (network round trips by construction: {round_trips})")
    for name, values in (("memory store", memory_latency), ("redis store", redis_latency)):
        print(f"{name:13s} per request: p50 {percentile(values, 50) * 1e3:6.2f} ms   p99 {percentile(values, 99) * 1e3:6.2f} ms")
    added = [r - m for r, m in zip(sorted(redis_latency), sorted(memory_latency))]
    print(f"added by Redis per request : p50 {percentile(added, 50) * 1e3:6.2f} ms   p99 {percentile(added, 99) * 1e3:6.2f} ms")
    for key in counter.scan_iter(f"{prefix}:*"):
        counter.delete(key)
    await redis_store.close()


if __name__ == "__main__":
    asyncio.run(main())
