"""Keeping tenants apart in an upstream's prefix cache.

An upstream that caches prompt prefixes answers a prompt it has seen faster and reports it as
cached: a tenant who can guess another tenant's recent prompt could confirm the guess from
`upstream_cached_tokens`, `upstream_compute_ms` or the response time. One `Isolation` per
upstream decides, per call, what keeps the guess blind; its `scope` is the tenant's cache scope
(`tenant:<id>`, or `shared` for tenants that chose to share):

- `TenantSlots` (llama-server): each call is pinned (`id_slot`) to a slot that holds only its
  scope's prompts; a slot last used by another scope is erased first. The server must not keep
  prompts outside its slots (`--cache-ram 0`) and must allow erasing (`--slot-save-path`). Slots
  are leased through the Store, so replicas sharing one server (and one Redis) keep this too.
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
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from adapters.store import SlotLease, Store, StoreSkipped, StoreUnavailable
from adapters.upstream_errors import UpstreamBusy, UpstreamUnavailable
from adapters.upstream_server import erase_slot, server_root


class Isolation(Protocol):
    """How one upstream keeps scopes apart. `reveals_cache`: may cached counts, compute times and
    the cached price reach the client? `lease` yields the body fields of one call in `scope`
    (`key` names the request, whose consecutive calls should reach the same cached sequence; `long`:
    the call is a whole answer, holding its slot far longer than a hand-off)."""

    reveals_cache: bool

    def lease(self, scope: str, key: str,
              long: bool = False) -> contextlib.AbstractAsyncContextManager[dict[str, Any]]: ...


class Shared:
    reveals_cache = True

    @contextlib.asynccontextmanager
    async def lease(self, scope: str, key: str, long: bool = False) -> AsyncIterator[dict[str, Any]]:
        yield {}


class Hidden(Shared):
    reveals_cache = False


class CacheSalt(Shared):
    @contextlib.asynccontextmanager
    async def lease(self, scope: str, key: str, long: bool = False) -> AsyncIterator[dict[str, Any]]:
        yield {"cache_salt": hashlib.sha256(scope.encode("utf-8")).hexdigest()}


class TenantSlots:
    """llama-server's `count` slots, each held by one call at a time and holding one scope's
    prompts. They are handed out through the Store (`slot_lease`), so every gateway process that
    shares it (replicas on one Redis) agrees on which scope each slot holds; with the in-process
    store they are this process's alone. Whole answers streamed through (`long` leases) never take
    the last free slot and one scope holds only its share of them (`store.long_lease_limits`), so
    that no tenant's streams keep the others' hand-offs waiting."""

    reveals_cache = True
    POLL_S = 0.05  # how often a call waiting for a slot asks again (another replica may free one)

    def __init__(self, count: int, erase: Callable[[int], Awaitable[None]], store: Store, server: str,
                 hold_s: float, wait_s: float | None = None) -> None:
        self._count, self._erase, self._store, self._server = count, erase, store, server
        self._hold_s, self._wait_s = hold_s, hold_s if wait_s is None else wait_s
        self._freed = asyncio.Condition()
        self._unreleased: list[tuple[SlotLease, bool]] = []  # releases the store missed, retried before a lease

    @classmethod
    def of_server(cls, api_base: str, count: int, timeout_s: float, store: Store, hold_s: float) -> "TenantSlots":
        """Slots of the llama-server at `api_base` (its /v1 URL), erased with its slot action; a
        call holds one for at most `hold_s` (then it is free again, should its process have died)
        and waits for one at most a call's time-out (`timeout_s`; then it is decoded locally)."""
        root = server_root(api_base)
        server = hashlib.sha256(root.encode("utf-8")).hexdigest()[:16]
        return cls(count, lambda slot: erase_slot(root, slot, timeout_s), store, server, hold_s, timeout_s)

    @contextlib.asynccontextmanager
    async def lease(self, scope: str, key: str, long: bool = False) -> AsyncIterator[dict[str, Any]]:
        held = await self._hold(scope, key, long)
        erased = not held.erase
        try:
            if held.erase:
                await self._erase(held.slot)
                erased = True
            yield {"id_slot": held.slot}
        finally:
            await asyncio.shield(self._free(held, erased))

    async def _hold(self, scope: str, key: str, long: bool) -> SlotLease:
        """A slot for this call, waiting (up to `wait_s`) while none may be had; then UpstreamBusy."""
        deadline = time.monotonic() + self._wait_s
        while True:
            lease = uuid.uuid4().hex
            try:
                await self._release_missed()
                held = await self._store.slot_lease(self._server, self._count, scope, key, self._hold_s, lease, long)
            except StoreUnavailable as exc:  # no one can say whose prompts a slot holds
                if not isinstance(exc, StoreSkipped):  # Redis may have granted it and lost the reply:
                    self._unreleased.append((SlotLease(-1, True, lease), False))  # its next holder erases
                raise UpstreamUnavailable(f"the upstream's slot leases are unreachable ({exc})") from exc
            except asyncio.CancelledError:  # the call ended with the reply in flight: it may hold a slot
                await asyncio.shield(self._free(SlotLease(-1, True, lease), False))
                raise
            if held is not None:
                return held
            if time.monotonic() > deadline:
                raise UpstreamBusy(f"no slot of the upstream's {self._count} came free within {self._wait_s:g} s")
            async with self._freed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), self.POLL_S)

    async def _free(self, held: SlotLease, erased: bool) -> None:
        self._unreleased.append((held, erased))
        with contextlib.suppress(StoreUnavailable):  # retried before the next lease: else the slot
            await self._release_missed()            # would stay held for the whole hold_s
        async with self._freed:
            self._freed.notify_all()

    async def _release_missed(self) -> None:
        """Give back the leases whose release the store missed (StoreUnavailable if it still does)."""
        for missed in list(self._unreleased):
            await self._store.slot_release(self._server, *missed)
            with contextlib.suppress(ValueError):  # another task gave it back meanwhile
                self._unreleased.remove(missed)
