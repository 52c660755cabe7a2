"""The admin API over tenants and keys (admin key only: a tenant's key is a 403, none a 401), and
the admin page that drives it (GET /admin, a static page like the playground).

Shaped after LiteLLM's proxy (/key/generate, /key/update, /key/delete) under this gateway's
/admin/ paths; the work is gateway/tenancy/changes.py's, the records the Store's, so every
replica sees a change within a second.
"""

from __future__ import annotations

import math
import time
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field, RootModel

from gateway.api.chat_completions import parse_body
from gateway.api.playground import HEADERS
from gateway.api.routes import require_admin, runtime_of
from gateway.config_checks import check_routing
from gateway.runtime import Runtime
from gateway.settings import TenantSettings
from gateway.tenancy.changes import DirectoryChanges, TenantCheck
from gateway.tenancy.records import KEY_FIELDS, KeyRecord
from gateway.wire.errors import InvalidRequest, quoted

PAGE = Path(__file__).with_name("static") / "admin.html"
# The admin key is checked before anything else; bodies are read after it, within the server's limits
# (parse_body), never by FastAPI before the dependency runs.
api = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
router = APIRouter()


class JsonObject(RootModel[dict[str, Any]]):
    """A body that must be a JSON object (a tenant's settings, or a merge patch of them)."""


class KeyRequest(BaseModel):
    """POST /admin/tenants/{id}/keys."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=64, description="What the key is for (shown in lists).")
    expires_at: int | None = Field(None, description="Unix time after which the key is refused.")
    expires_in_s: int | None = Field(None, ge=1, description="Or: seconds from now until it is refused.")
    scopes: list[str] | None = Field(None, description="Aliases the key may use (within its tenant's); none: all "
                                     "of the tenant's.")


def changes_of(request: Request) -> DirectoryChanges:
    """The directory changes of the request's runtime: its Store, its directory, its checks."""
    runtime = runtime_of(request)
    return DirectoryChanges(runtime.ledger.store, runtime.tenants, tenant_check(runtime))


def tenant_check(runtime: Runtime) -> TenantCheck:
    """Refuse (400 naming the field) a tenant's settings that start-up would refuse or warn about:
    the shadow operator's id (its ledger is the shadow budget's), an alias that does not exist, or
    a routing override under which an alias the tenant may use refuses every request that brings no
    routing of its own (gateway/config_checks.py's check_routing)."""
    def check(tenant: TenantSettings) -> None:
        operator = runtime.settings.shadow.operator
        if tenant.id == operator:
            raise InvalidRequest(f"'{operator}' is the shadow answers' operator id (shadow.operator)", param="id")
        for index, alias in enumerate(tenant.aliases or []):
            if alias not in runtime.aliases:
                raise InvalidRequest(f"no alias '{quoted(alias)}'", param=f"aliases[{index}]")
        settings = runtime.settings.model_copy(update={"tenants": [tenant]})
        routers = {name: getattr(runtime.aliases.get(name), "router", None) for name in settings.aliases}
        refused = check_routing(settings, routers)
        if refused:
            raise InvalidRequest(f"this routing would refuse requests: {refused[0]}", param="routing")

    return check


def tenant_view(settings: TenantSettings, keys: list[KeyRecord]) -> dict[str, Any]:
    return {"object": "tenant", "id": settings.id, "settings": settings.model_dump(mode="json", exclude=KEY_FIELDS),
            "keys": in_order(keys)}


def in_order(keys: list[KeyRecord]) -> list[dict[str, Any]]:
    return [key.view() for key in sorted(keys, key=lambda k: (k.created_at, k.id))]


@router.get("/admin", include_in_schema=False)
async def admin_page() -> HTMLResponse:
    """The admin page: it asks for the admin key and holds it in memory only."""
    return HTMLResponse(page(), headers=HEADERS)


@cache
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


@api.get("/tenants")
async def list_tenants(request: Request):
    """Every tenant, with its keys (never their secrets or digests)."""
    return {"object": "list", "data": [tenant_view(*t) for t in await changes_of(request).tenants()]}


@api.post("/tenants", status_code=201)
async def create_tenant(request: Request):
    """A new tenant from its settings (as in config.yaml, less the key fields), with no key yet."""
    settings = await changes_of(request).create_tenant((await parse_body(request, JsonObject)).root)
    return tenant_view(settings, [])


@api.get("/tenants/{tenant_id}")
async def read_tenant(tenant_id: str, request: Request):
    """One tenant and its keys; 404 if there is none."""
    return tenant_view(*await changes_of(request).tenant(tenant_id))


@api.patch("/tenants/{tenant_id}")
async def update_tenant(tenant_id: str, request: Request):
    """Change a tenant's budgets, rate limits, routing, allowed aliases...: a JSON Merge Patch
    (RFC 7386) of its settings, so `{"daily": {"upstream_tokens": 5000}}` changes that one value."""
    changes = changes_of(request)
    await changes.update_tenant(tenant_id, (await parse_body(request, JsonObject)).root)
    return tenant_view(*await changes.tenant(tenant_id))


@api.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: str, request: Request):
    """The tenant's keys, oldest first (never their secrets or digests); 404 for no such tenant."""
    _, keys = await changes_of(request).tenant(tenant_id)
    return {"object": "list", "data": in_order(keys)}


@api.post("/tenants/{tenant_id}/keys", status_code=201)
async def issue_key(tenant_id: str, request: Request):
    """A new key for the tenant; the response holds the key itself, shown this once."""
    runtime, body, changes = runtime_of(request), await parse_body(request, KeyRequest), changes_of(request)
    tenant, _ = await changes.tenant(tenant_id)
    for index, alias in enumerate(body.scopes or []):
        if alias not in runtime.aliases:
            raise InvalidRequest(f"no alias '{quoted(alias)}'", param=f"scopes[{index}]")
        if not tenant.may_use(alias):
            raise InvalidRequest(f"tenant '{quoted(tenant_id)}' may not use alias '{quoted(alias)}': a key's scopes "
                                 "narrow its tenant's aliases", param=f"scopes[{index}]")
    record, secret = await changes.issue_key(tenant_id, body.name, expiry(body), body.scopes)
    return {**record.view(), "key": secret}


def expiry(body: KeyRequest) -> int | None:
    """The key's expiry as Unix time: `expires_at`, or at least `expires_in_s` from now (rounded up
    to the second, never down: a key given 1 s must not expire within the current second)."""
    if body.expires_at is not None and body.expires_in_s is not None:
        raise InvalidRequest("give expires_at or expires_in_s, not both", param="expires_in_s")
    if body.expires_in_s is not None:
        return math.ceil(time.time()) + body.expires_in_s
    if body.expires_at is not None and body.expires_at <= time.time():
        raise InvalidRequest("expires_at is in the past", param="expires_at")
    return body.expires_at


@api.get("/keys/{key_id}")
async def read_key(key_id: str, request: Request):
    """One key's record (never its secret or digest); 404 if there is none."""
    record, _ = await changes_of(request).key(key_id)
    return record.view()


@api.post("/keys/{key_id}/rotate")
async def rotate_key(key_id: str, request: Request):
    """A new secret for the key, shown this once; the old secret is refused from the next request."""
    record, secret = await changes_of(request).rotate_key(key_id)
    return {**record.view(), "key": secret}


@api.delete("/keys/{key_id}")
async def revoke_key(key_id: str, request: Request):
    """Delete the key: from the next request on, it is a 401 on every replica."""
    record = await changes_of(request).revoke_key(key_id)
    return {"id": record.id, "object": "key", "tenant": record.tenant, "deleted": True}


@api.get("/audit")
async def read_audit(request: Request, limit: int = Query(100, ge=1, le=1000)):
    """The latest changes to tenants and keys, newest first: who, when (Unix time), what."""
    return {"object": "list", "data": await changes_of(request).audit(limit)}


router.include_router(api)
