"""Tenants: who a bearer key belongs to and what that tenant may do."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from adapters.store import Limits, RateLimits
from gateway.settings import SettingsError, TenantSettings


@dataclass(frozen=True)
class Tenant:
    id: str
    settings: TenantSettings

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
        return self.settings.may_use(alias)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class TenantDirectory:
    """Looks up tenants by API key; keys are held only as SHA-256 digests."""

    def __init__(self, tenants: list[TenantSettings], environ: Mapping[str, str], admin_key_env: str) -> None:
        self._by_digest: dict[str, Tenant] = {}
        self.by_id: dict[str, Tenant] = {}
        for settings in tenants:
            digest = settings.api_key_sha256
            if settings.api_key_env:
                key = environ.get(settings.api_key_env)
                if not key:
                    raise SettingsError(f"tenants.{settings.id}.api_key_env: environment variable {settings.api_key_env} is not set")
                digest = key_digest(key)
            tenant = Tenant(settings.id, settings)
            self._by_digest[digest.lower()] = tenant
            self.by_id[settings.id] = tenant
        admin_key = environ.get(admin_key_env)
        self._admin_digest = key_digest(admin_key) if admin_key else None

    def authenticate(self, key: str) -> Tenant | None:
        return self._by_digest.get(key_digest(key))  # a digest lookup leaks nothing useful by timing

    def is_admin(self, key: str) -> bool:
        return self._admin_digest is not None and hmac.compare_digest(self._admin_digest, key_digest(key))
