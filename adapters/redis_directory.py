"""The tenant directory's part of RedisStore (adapters/redis_store.py, which lists every key): the
tenants and key records, the version replicas poll and its epoch, and the audit log, all under one
hash tag so that one Lua script changes them together, also on a Redis Cluster.

The keys have no TTL: `_check_eviction` warns once if Redis's maxmemory-policy may evict them.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from adapters.store import AUDIT_MAX_ENTRIES, DirectoryRecords, DirectoryVersion, DirectoryWrite, StoreUnavailable

DIRECTORY_TAG = "tenants:"  # the whole tenant directory in one Cluster slot: one script changes it
log = logging.getLogger("gateway.store")


class RedisDirectory:
    """The Store's directory methods, mixed into RedisStore: they call its `_run` (one blocking call on
    its pool, failures as StoreUnavailable) and `_key`, and use its client and write script."""

    _redis: Any
    _cluster: bool
    _directory_write_script: Any
    _eviction_checked = False  # set once INFO memory was read

    async def directory_write(self, writes: Sequence[DirectoryWrite], audit: str) -> bool:
        tables = {"tenants": 1, "keys": 2}
        args: list[Any] = [audit, AUDIT_MAX_ENTRIES]
        for write in writes:
            expected = "*" if write.expected is None else "-" if write.expected == "" else "=" + write.expected
            args += [tables[write.table], write.name, expected, "-" if write.value is None else "=" + write.value]
        keys = [self._key(DIRECTORY_TAG, part) for part in ("tenants", "keys", "version", "audit")]
        return bool(await self._run(lambda: self._directory_write_script(keys=keys, args=args)))

    async def directory_version(self) -> DirectoryVersion:
        def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(self._key(DIRECTORY_TAG, "epoch"))
            pipe.get(self._key(DIRECTORY_TAG, "version"))
            return pipe.execute()

        epoch, version = await self._run(read)
        return DirectoryVersion(epoch or await self._new_epoch(), int(version or 0))

    async def _new_epoch(self) -> str:
        """Mark the directory Redis holds now with a random id; another process's, if it was first.
        Only a Redis without one writes here: a full Redis (noeviction) refuses writes, not polls."""
        key = self._key(DIRECTORY_TAG, "epoch")

        def mark() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(key, uuid.uuid4().hex, nx=True)
            pipe.get(key)
            return pipe.execute()

        return (await self._run(mark))[1]

    async def directory_read(self) -> DirectoryRecords:
        def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)  # one snapshot: a version and the records it names
            pipe.get(self._key(DIRECTORY_TAG, "epoch"))
            pipe.get(self._key(DIRECTORY_TAG, "version"))
            pipe.hgetall(self._key(DIRECTORY_TAG, "tenants"))
            pipe.hgetall(self._key(DIRECTORY_TAG, "keys"))
            return pipe.execute()

        if not self._eviction_checked:
            await self._check_eviction()
        epoch, version, tenants, keys = await self._run(read)
        version = DirectoryVersion(epoch or await self._new_epoch(), int(version or 0))
        return DirectoryRecords(version, tenants, keys)

    async def _check_eviction(self) -> None:
        """Warn once if Redis may evict the directory: its keys have no TTL, so only an allkeys-*
        policy drops them (noeviction and volatile-* never do). A Redis that refuses INFO is not checked."""
        target = {"target_nodes": RedisCluster.PRIMARIES} if self._cluster else {}

        def read() -> dict[str, Any]:
            try:
                return self._redis.info("memory", **target)
            except ResponseError:  # INFO renamed away (some managed Redis)
                return {}

        try:
            info = await self._run(read)
        except StoreUnavailable:
            return  # checked at the next read
        self._eviction_checked = True
        nodes = [info] if "maxmemory_policy" in info else [n for n in info.values() if isinstance(n, dict)]
        evicting = sorted({policy for n in nodes if (policy := str(n.get("maxmemory_policy"))).startswith("allkeys-")})
        if evicting:
            log.warning("Redis evicts with maxmemory-policy %s: once full it may drop tenants, keys or the directory's "
                        "version (they have no TTL); set maxmemory-policy noeviction or volatile-lru "
                        "(docs/deployment.md, Tenants and keys)", ", ".join(evicting))

    async def audit_read(self, limit: int) -> list[str]:
        key = self._key(DIRECTORY_TAG, "audit")
        return await self._run(lambda: self._redis.lrange(key, 0, max(0, limit - 1)))
