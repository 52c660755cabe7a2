"""Tenants: who a bearer key belongs to and what that tenant may do.

The directory answers every lookup from a snapshot in memory, so authentication never waits on
the Store. `keep_current` seeds the Store with config.yaml's tenants (the Store wins: a tenant it
already holds is left as it is) and then polls the Store's directory version every
`REFRESH_S`, reloading the snapshot when it changed: a key issued, revoked or rotated on any replica
is honoured by every replica within a second. While the Store does not answer, the last snapshot
keeps serving (before the first one: config.yaml's tenants, as without a Store).

A Store that lost the directory (a Redis that restarted empty) shows a new epoch in its version:
config.yaml's tenants are seeded again and the snapshot reloaded, so keys issued through the API
before the loss stop working here as they do on every other replica.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from adapters.store import (
    DirectoryRecords,
    DirectoryVersion,
    DirectoryWrite,
    Limits,
    RateLimits,
    Store,
    StoreUnavailable,
)
from gateway.settings import SettingsError, TenantSettings
from gateway.tenancy.records import KeyRecord, audit_entry, key_digest, tenant_from_json, tenant_json, unreadable

__all__ = ["ADMIN_ACTOR", "REFRESH_S", "Tenant", "TenantDirectory"]
log = logging.getLogger("gateway.tenancy")
REFRESH_S = 0.25  # how often each replica asks the Store whether the directory changed
SEED_ACTOR = "config.yaml"
ADMIN_ACTOR = "admin"  # the audit log's name for the admin key: nothing derived from the key itself


@dataclass(frozen=True)
class Tenant:
    id: str
    settings: TenantSettings
    scopes: frozenset[str] | None = None  # the key's own aliases, within the tenant's; None: the tenant's

    @property
    def limits(self) -> Limits:
        s = self.settings
        return Limits(s.daily.upstream_tokens, s.daily.upstream_cost_usd, s.monthly.upstream_tokens, s.monthly.upstream_cost_usd)

    @property
    def rate_limits(self) -> RateLimits:
        r = self.settings.rate_limits
        return RateLimits(r.requests_per_minute, r.tokens_per_minute, r.max_parallel)

    @property
    def cache_scope(self) -> str:
        """Whose cached prefixes and continuations this tenant's requests may reuse: its own
        (`tenant:<id>`), or those of every tenant that says `cache_scope: shared`."""
        return "shared" if self.settings.cache_scope == "shared" else f"tenant:{self.id}"

    def may_use(self, alias: str) -> bool:
        return self.settings.may_use(alias) and (self.scopes is None or alias in self.scopes)


@dataclass(frozen=True)
class _Snapshot:
    version: DirectoryVersion | None  # None: config.yaml's tenants, before the Store answered
    by_id: dict[str, Tenant]
    keys: dict[str, KeyRecord]  # by digest


class TenantDirectory:
    """Looks up tenants by API key; keys are held only as SHA-256 digests."""

    def __init__(self, tenants: list[TenantSettings], environ: Mapping[str, str], admin_key_env: str) -> None:
        self.seed: list[tuple[TenantSettings, str]] = []  # config.yaml's tenants and their keys' digests
        for settings in tenants:
            digest = settings.api_key_sha256
            if settings.api_key_env:
                key = environ.get(settings.api_key_env)
                if not key:
                    raise SettingsError(f"tenants.{settings.id}.api_key_env: environment variable {settings.api_key_env} is not set")
                digest = key_digest(key)
            self.seed.append((settings, digest.lower()))
        self._snapshot = _Snapshot(None, {s.id: Tenant(s.id, s) for s, _ in self.seed},
                                   {d: _seed_key(s, d) for s, d in self.seed})
        admin_key = environ.get(admin_key_env)
        self._admin_digest = key_digest(admin_key) if admin_key else None
        self._seeded = False
        self._refreshing = asyncio.Lock()  # the poll and an admin change's own refresh, one at a time

    @property
    def by_id(self) -> dict[str, Tenant]:
        """Every tenant of the current snapshot, by id (config.yaml's until the Store first answers)."""
        return self._snapshot.by_id

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant whose live key this is (narrowed to the key's scopes), or None: unknown,
        revoked or expired."""
        record = self._snapshot.keys.get(key_digest(key))  # a digest lookup leaks nothing useful by timing
        tenant = None if record is None or record.expired(time.time()) else self._snapshot.by_id.get(record.tenant)
        if tenant is None or record.scopes is None:
            return tenant
        return Tenant(tenant.id, tenant.settings, frozenset(record.scopes))

    def is_admin(self, key: str) -> bool:
        """Whether `key` is the admin key (compared as digests, in constant time)."""
        return self._admin_digest is not None and hmac.compare_digest(self._admin_digest, key_digest(key))

    async def keep_current(self, store: Store, interval_s: float = REFRESH_S) -> None:
        """Run until cancelled: seed the Store once it answers, then follow its changes. No error
        ends it: one that is not the Store's outage is logged (once while it repeats) and the poll
        goes on, since a replica that stopped following would keep honouring revoked keys."""
        failing = None
        while True:
            try:
                if not self._seeded:
                    await self.seed_store(store)
                await self.refresh(store)
                failing = None
            except StoreUnavailable:
                pass  # the last snapshot keeps serving; the store logs its own outage
            except Exception as exc:  # the poll must outlive any one failure
                if repr(exc) != failing:
                    log.exception("following the tenant directory failed; the last snapshot keeps serving")
                failing = repr(exc)
            await asyncio.sleep(interval_s)

    async def refresh(self, store: Store) -> None:
        """Reload the snapshot if the Store's directory changed since; raises StoreUnavailable.
        One refresh at a time, so a slower one never installs an older snapshot over a newer."""
        async with self._refreshing:
            version = await store.directory_version()
            if version == self._snapshot.version:
                return
            held = self._snapshot.version
            if held is not None and version.epoch != held.epoch:
                log.warning("the Store lost the tenant directory (a Redis that restarted empty?); seeding it "
                            "again from config.yaml")
                await self.seed_store(store)
            self._snapshot = _snapshot_of(await store.directory_read())

    async def seed_store(self, store: Store) -> None:
        """Write config.yaml's tenants, each with its key, where the Store has no tenant of that id
        (the Store wins: a tenant it holds keeps the settings and keys it was given there). For a
        tenant it holds, warn if the file's key is not the one its `key_config_<id>` record holds."""
        held = await store.directory_read()
        for settings, digest in self.seed:
            if settings.id in held.tenants:
                _compare_seeded_key(settings, digest, held.keys)
                continue
            key = _seed_key(settings, digest)
            writes = [DirectoryWrite("tenants", settings.id, tenant_json(settings), expected=""),
                      DirectoryWrite("keys", key.id, key.model_dump_json(), expected="")]
            entry = audit_entry(SEED_ACTOR, "tenant.seed", tenant=settings.id, key=key.id)
            await store.directory_write(writes, entry)  # refused: another replica seeded it just now
        self._seeded = True


def _snapshot_of(records: DirectoryRecords) -> _Snapshot:
    """The records as a snapshot; a record this version of the gateway cannot read is skipped."""
    tenants = {}
    for tenant_id, text in records.tenants.items():
        try:
            tenants[tenant_id] = Tenant(tenant_id, tenant_from_json(text))
        except (ValidationError, ValueError) as exc:  # written by another version of the gateway
            log.warning("tenant %s in the Store is not valid here, skipped: %s", tenant_id, unreadable(exc))
    keys = {}
    for text in records.keys.values():
        try:
            record = KeyRecord.model_validate_json(text)
        except ValidationError:
            continue
        keys[record.digest] = record
    return _Snapshot(records.version, tenants, keys)


def _compare_seeded_key(settings: TenantSettings, digest: str, keys: Mapping[str, str]) -> None:
    """Log that a seeded tenant keeps the Store's settings, and warn if the file's key is not the one
    its seeded key record holds (changed in the file or the environment, or rotated through the API):
    the Store's wins, and a Store that loses its data would bring the file's back."""
    log.info("tenants.%s: the Store already holds this tenant; it keeps its settings and keys from there "
             "(config.yaml's apply only to tenants new to the Store)", settings.id)
    key_id = _seed_key_id(settings.id)
    try:
        held = KeyRecord.model_validate_json(keys[key_id]) if key_id in keys else None
    except ValidationError:
        return
    if held is not None and held.digest != digest:
        source = f"${settings.api_key_env}" if settings.api_key_env else "api_key_sha256"
        log.warning("tenants.%s: the key in config.yaml (%s) is not the one the Store holds for %s, which wins: "
                    "the file's key is refused. To replace a leaked or changed key, rotate it through the admin "
                    "API (POST /admin/keys/%s/rotate) and hand out the new one, or revoke it and issue another; "
                    "then set the file to the key in use (a Store that lost its data is seeded from the file)",
                    settings.id, source, key_id, key_id)


def _seed_key_id(tenant_id: str) -> str:
    """The id of the key a tenant of config.yaml is seeded with."""
    return f"key_config_{tenant_id}"


def _seed_key(settings: TenantSettings, digest: str) -> KeyRecord:
    return KeyRecord(id=_seed_key_id(settings.id), tenant=settings.id, name="config.yaml", digest=digest,
                     created_at=int(time.time()))
