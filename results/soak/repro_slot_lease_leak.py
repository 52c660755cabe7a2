"""Minimal reproduction (gateway bug found by bench/soak.py): a tenant slot lease whose release
falls in a Redis outage is never given back, so after Redis is back every call that wants a slot
waits the whole hold_s (130 s with default settings: passthrough_timeout_s 120 + margin) and then
fails over to local. Run: PYTHONPATH=. .venv/bin/python results/soak/repro_slot_lease_leak.py
"""
import asyncio
import tempfile
import time
from pathlib import Path

from adapters.cache_isolation import TenantSlots
from adapters.redis_store import RedisStore
from adapters.upstream_errors import UpstreamUnavailable
from bench.soak_processes import PrivateRedis

HOLD_S = 5.0  # the gateway uses ~130 s


async def main() -> None:
    with PrivateRedis(Path(tempfile.mkdtemp())) as redis_server:
        store = RedisStore(redis_server.url, "repro", 0.25, 60, 3600)

        async def erase(slot: int) -> None:
            pass

        slots = TenantSlots(1, erase, store, "server", HOLD_S)
        leased_at = time.monotonic()
        async with slots.lease("tenant:a", "request-1") as fields:
            print("leased", fields)
            redis_server._process.kill()  # Redis dies while the call holds its slot ...
            redis_server._process.wait()
        redis_server._process = redis_server._start()  # ... and is back (AOF) a moment later
        await asyncio.sleep(1.1)  # past the store's 1 s skip after failures
        started = time.monotonic()
        try:
            async with slots.lease("tenant:b", "request-2") as fields:
                print(f"leased {fields} after waiting {time.monotonic() - started:.1f} s, "
                      f"{time.monotonic() - leased_at:.1f} s after the first lease (hold_s {HOLD_S}): "
                      "the lost release kept the slot until its lease ran out")
        except UpstreamUnavailable as exc:
            print(f"no slot after {time.monotonic() - started:.1f} s: {exc}")
        await store.close()


asyncio.run(main())
