"""Keeping tenants apart in an upstream's prefix cache.

An upstream that caches prompt prefixes answers a prompt it has seen faster and reports it as
cached: a tenant who can guess another tenant's recent prompt could confirm the guess from
`upstream_cached_tokens`, `upstream_compute_ms` or the response time. One `Isolation` per
upstream decides, per call, what keeps the guess blind; its `scope` is the tenant's cache scope
(`tenant:<id>`, or `shared` for tenants that chose to share):

- `TenantSlots` (llama-server): each call is pinned (`id_slot`) to a slot that holds only its
  scope's prompts; a slot last used by another scope is erased first. The server must not keep
  prompts outside its slots (`--cache-ram 0`) and must allow erasing (`--slot-save-path`).
- `CacheSalt` (vLLM): a per-scope `cache_salt`, which vLLM mixes into its prefix-cache hashes.
- `Hidden` (any other provider, whose cache the gateway cannot partition): cached counts and
  compute times are not reported, and cached tokens are billed at the full price, so no field
  says whether a prefix matched. The provider's own latency gain on a hit remains.
- `Shared`: no isolation; counts reported as the provider gives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from adapters.upstream_server import erase_slot, server_root


class Isolation(Protocol):
    """How one upstream keeps scopes apart. `reveals_cache`: may cached counts, compute times and
    the cached price reach the client? `lease` yields the body fields of one call in `scope`
    (`key` names the request, whose consecutive calls should reach the same cached sequence)."""

    reveals_cache: bool

    def lease(self, scope: str, key: str) -> contextlib.AbstractAsyncContextManager[dict[str, Any]]: ...


class Shared:
    reveals_cache = True

    @contextlib.asynccontextmanager
    async def lease(self, scope: str, key: str) -> AsyncIterator[dict[str, Any]]:
        yield {}


class Hidden(Shared):
    reveals_cache = False


class CacheSalt(Shared):
    @contextlib.asynccontextmanager
    async def lease(self, scope: str, key: str) -> AsyncIterator[dict[str, Any]]:
        yield {"cache_salt": hashlib.sha256(scope.encode("utf-8")).hexdigest()}


@dataclass
class _Slot:
    id: int
    scope: str | None = None  # whose prompts it may hold (None: nobody's yet)
    key: str = ""  # the request that used it last
    busy: bool = False
    used_at: float = 0.0


class TenantSlots:
    """llama-server's `count` slots, each leased to one call at a time and holding one scope's prompts."""

    reveals_cache = True

    def __init__(self, count: int, erase: Callable[[int], Awaitable[None]]) -> None:
        self._slots = [_Slot(i) for i in range(count)]
        self._erase = erase
        self._free = asyncio.Condition()

    @classmethod
    def of_server(cls, api_base: str, count: int, timeout_s: float) -> "TenantSlots":
        """Slots of the llama-server at `api_base` (its /v1 URL), erased with its slot action."""
        root = server_root(api_base)
        return cls(count, lambda slot: erase_slot(root, slot, timeout_s))

    @contextlib.asynccontextmanager
    async def lease(self, scope: str, key: str) -> AsyncIterator[dict[str, Any]]:
        async with self._free:
            await self._free.wait_for(lambda: any(not s.busy for s in self._slots))
            slot = max((s for s in self._slots if not s.busy), key=lambda s: self._fit(s, scope, key))
            slot.busy = True
        try:
            if slot.scope != scope:
                if slot.scope is not None:
                    await self._erase(slot.id)
                slot.scope = scope
            slot.key, slot.used_at = key, time.monotonic()
            yield {"id_slot": slot.id}
        finally:
            async with self._free:
                slot.busy = False
                self._free.notify()

    @staticmethod
    def _fit(slot: _Slot, scope: str, key: str) -> tuple[int, float]:
        """The request's own slot first, then one of its scope, then an unused one, then the one
        idle longest (it will be erased)."""
        if slot.scope == scope:
            return (3 if slot.key == key else 2), -slot.used_at
        return (1 if slot.scope is None else 0), -slot.used_at
