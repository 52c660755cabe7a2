"""The HTTP endpoints besides chat completions (api/chat_completions.py): models, usage, health, and
the authentication every endpoint shares. Each handler is thin: authenticate, delegate, render."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import AppStatus

from gateway.runtime import Runtime
from gateway.settings import RoutingOverride, RoutingSettings
from gateway.shadow.report import MAX_MINUTES, quality_report
from gateway.tenancy.changes import NotFound
from gateway.tenancy.tenants import Tenant
from gateway.wire.errors import Forbidden, GatewayError, InvalidRequest, Unauthenticated, quoted

router = APIRouter()


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


def bearer_key(request: Request) -> str:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthenticated("Missing API key: send 'Authorization: Bearer <key>'.")
    return key.strip()


def authenticate(request: Request) -> Tenant:
    tenant = runtime_of(request).tenants.authenticate(bearer_key(request))
    if tenant is None:
        raise Unauthenticated("Incorrect API key provided.")
    return tenant


@router.get("/v1/models")
async def list_models(request: Request):
    runtime = runtime_of(request)
    tenant = authenticate(request)
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "routing-gateway",
         "local": alias.settings.local, "upstream": alias.settings.upstream,
         "routing": tenant_view(alias.settings.routing)}
        for name, alias in runtime.aliases.items() if tenant.may_use(name)
    ]
    return {"object": "list", "data": data}


def tenant_view(routing: RoutingSettings) -> dict:
    """An alias's default routing as a tenant sees it: the fields a tenant's or request's `routing`
    may set. The rest is the operator's (shadow rate, quality target, knob bounds, router and
    check files)."""
    shown = routing.model_dump(include=set(RoutingOverride.model_fields), exclude_none=True)
    if isinstance(routing.answer_check, str):  # a fitted check file: the configuration's to name
        shown.pop("answer_check", None)
    return shown


@router.get("/v1/usage")
async def tenant_usage(request: Request):
    tenant = authenticate(request)
    return await _usage(runtime_of(request), tenant)


def require_admin(request: Request) -> None:
    """Pass the admin key; a tenant's key is a 403, anything else a 401."""
    runtime = runtime_of(request)
    key = bearer_key(request)
    if not runtime.tenants.is_admin(key):
        if runtime.tenants.authenticate(key) is not None:
            raise Forbidden("This endpoint needs the admin key.")
        raise Unauthenticated("Incorrect API key provided.")


@router.get("/admin/tenants/{tenant_id}/usage")
async def admin_usage(tenant_id: str, request: Request):
    runtime = runtime_of(request)
    require_admin(request)
    tenant = runtime.tenants.by_id.get(tenant_id)
    if tenant is None:
        raise NotFound(f"no tenant '{quoted(tenant_id)}'", param="tenant_id")
    return await _usage(runtime, tenant)


@router.get("/admin/quality")
async def admin_quality(request: Request, alias: str | None = None, minutes: str = "60"):
    """Shadow answers' figures per alias and tenant (gateway/shadow/report.py), for the admin key."""
    from adapters.store import StoreUnavailable

    runtime = runtime_of(request)
    require_admin(request)
    if not (minutes.isascii() and minutes.isdigit() and 1 <= int(minutes) <= MAX_MINUTES):
        raise InvalidRequest(f"minutes must be a whole number from 1 to {MAX_MINUTES}", param="minutes")
    shadow = runtime.shadow
    if alias is not None and (shadow is None or alias not in shadow.lanes):
        error = InvalidRequest(f"no alias '{quoted(alias)}' with shadow answers", param="alias")
        error.status, error.code = 404, "not_found"
        raise error
    if shadow is None:
        return {"object": "quality", "aliases": []}
    try:
        return await quality_report(shadow, runtime.ledger.clock(), alias, int(minutes))
    except StoreUnavailable as exc:
        error = GatewayError("the store is unreachable; retry shortly")
        error.status, error.code = 503, "store_unavailable"
        raise error from exc


async def _usage(runtime: Runtime, tenant: Tenant) -> dict:
    from adapters.store import StoreUnavailable

    try:
        windows = await runtime.ledger.store.usage(tenant.id, runtime.ledger.clock())
    except StoreUnavailable as exc:
        error = GatewayError("the usage ledger is unreachable; retry shortly")
        error.status, error.code = 503, "store_unavailable"
        raise error from exc
    budgets = {"day": tenant.settings.daily, "month": tenant.settings.monthly}
    return {
        "tenant": tenant.id,
        "windows": [
            {**vars(w), "limits": budgets[w.period].model_dump()} for w in windows
        ],
    }


@router.get("/health/live")
async def live():
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(request: Request):
    runtime = runtime_of(request)
    store_ok = await runtime.ledger.store.ping()
    # sse-starlette flags uvicorn's SIGTERM (it drains streams on it); the lifespan then closes us.
    draining = AppStatus.should_exit or runtime.closed
    body = {
        "status": "draining" if draining else "ready",
        "store": "ok" if store_ok else "unavailable",
        "mode": "routing" if store_ok else "local_only",
        "unsettled_usage": runtime.ledger.unsettled,
        "unreleased_holds": runtime.ledger.unreleased,
        "queue_depth": {name: model.queue_depth for name, model in runtime.local_models.items()},
    }
    return JSONResponse(body, status_code=503 if draining else 200)
