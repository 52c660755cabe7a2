"""What the tenant directory keeps in the Store, as JSON texts: a tenant's settings (TenantSettings
without its key fields), one record per API key (its SHA-256 digest, never the key), and audit entries."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.settings import STORED_TENANT, TenantSettings

KEY_FIELDS = {"api_key_sha256", "api_key_env"}  # a tenant's settings in the file only: the Store keeps key records


def key_digest(key: str) -> str:
    """The SHA-256 hex of `key`: how a key is stored and looked up (keys are 256 random bits, or the
    operator's own, so an unsalted hash is what a lookup by key needs)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_secret() -> str:
    """A fresh API key: 'sk-' and 43 URL-safe characters (256 random bits)."""
    return "sk-" + secrets.token_urlsafe(32)


def new_key_id() -> str:
    """A fresh key id ('key_' and 16 hex digits): public, names a key in the API and the audit log."""
    return "key_" + secrets.token_hex(8)


class KeyRecord(BaseModel):
    """One API key of a tenant, as stored: the key itself is never kept, only its digest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    tenant: str
    name: str
    digest: str = Field(..., description="SHA-256 hex of the key.")
    created_at: int
    expires_at: int | None = Field(None, description="Unix time after which the key is refused; None: never.")
    scopes: list[str] | None = Field(None, description="Aliases this key may use, within its tenant's; None: all "
                                     "of the tenant's.")
    rotated_at: int | None = None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def view(self) -> dict[str, Any]:
        """The record as the admin API shows it: no digest."""
        return {"object": "key", **self.model_dump(exclude={"digest"})}


def tenant_json(settings: TenantSettings) -> str:
    """A tenant's settings as the Store keeps them: what was set, less the key fields."""
    return json.dumps(settings.model_dump(mode="json", exclude_unset=True, exclude=KEY_FIELDS), sort_keys=True)


def tenant_from_json(text: str) -> TenantSettings:
    """A tenant's settings as the Store keeps them (tenant_json's text); raises pydantic's
    ValidationError, or ValueError for text that is not JSON."""
    return TenantSettings.model_validate(json.loads(text), context={STORED_TENANT: True})


def tenant_from_dict(data: dict[str, Any]) -> TenantSettings:
    """A tenant's settings as the admin API sends them; raises pydantic's ValidationError."""
    return TenantSettings.model_validate(data, context={STORED_TENANT: True})


def audit_entry(actor: str, action: str, **what: Any) -> str:
    """One audit log entry: who, when (Unix time), what. Callers never pass a key or its digest."""
    return json.dumps({"at": round(time.time(), 3), "actor": actor, "action": action, **what}, sort_keys=True)


def unreadable(exc: Exception) -> str:
    """Why a stored record could not be read, for the log: the fields and error kinds only, never
    the values (a key record holds its digest)."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, error['loc'])) or 'record'}: {error['type']}" for error in exc.errors())
    return type(exc).__name__
