"""One request, as the middleware sees it: timed, counted by endpoint, alias and status, logged in
one line (gateway/logs.py formats it), with the error code of a refused one; and /metrics itself."""

from __future__ import annotations

import contextvars
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.observability.registry import Metrics
from gateway.observability.tracing import finish_request, request_span
from gateway.wire.errors import GatewayError, Unauthenticated

log = logging.getLogger("gateway.requests")
router = APIRouter()

API_PREFIXES = ("/v1/", "/admin/")  # routes counted by endpoint; /metrics, /health/ and the playground are not
CHAT_ENDPOINT = "/v1/chat/completions"
QUIET_PATHS = ("/metrics", "/health/")  # scraped every few seconds: logged at DEBUG only
UNKNOWN = "unknown"


@router.get("/metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus metrics: for the admin key only, unless `server.public_metrics`."""
    if not request.app.state.public_metrics:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not request.app.state.runtime.tenants.is_admin(key.strip()):
            raise Unauthenticated("/metrics needs the admin key: send 'Authorization: Bearer <admin key>'.")
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# -- wiring (called from create_app and its lifespan) --

def install(app: FastAPI, metrics: Metrics, public: bool = False) -> None:
    """Serve /metrics (to the admin key only unless `public`), measure every request, and note the
    error code of each refused one."""
    app.state.metrics, app.state.public_metrics = metrics, public
    app.include_router(router)
    for kind, handler in list(app.exception_handlers.items()):
        app.exception_handlers[kind] = _noting_error(handler)
    app.add_middleware(ObservabilityMiddleware, metrics=metrics)


def _noting_error(handler):
    async def handle(request: Request, exc: Exception):
        record = _record.get()
        if record is not None:
            record.error = error_reason(exc)
        response = handler(request, exc)
        return await response if inspect.isawaitable(response) else response

    return handle


def error_reason(exc: BaseException) -> str:
    """A bounded label for an error: its OpenAI code, else its type, else the HTTP status."""
    if isinstance(exc, GatewayError):
        return exc.code or exc.type
    status = getattr(exc, "status_code", None)
    return f"http_{status}" if isinstance(status, int) else "internal_error"


# -- one request --

@dataclass
class RequestRecord:
    """What the middleware and the route hooks learn about one request."""

    metrics: Metrics
    started: float
    status: int | None = None
    model: str | None = None
    tenant: str | None = None
    ttft_s: float | None = None
    error: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    started_ns: int = field(default_factory=time.time_ns)  # wall clock, for spans timed after the fact
    admission_ns: int | None = None  # the route named the model: admission starts
    admitted_ns: int | None = None  # the answer's alias was noted: admission ended
    _alias: str | None = field(default=None, repr=False)

    @property
    def alias(self) -> str | None:
        """The alias that answers, noted once the request is admitted (answers.metered, count_passthrough)."""
        return self._alias

    @alias.setter
    def alias(self, name: str | None) -> None:
        self._alias = name
        if self.admitted_ns is None:
            self.admitted_ns = time.time_ns()


_record: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("gateway_request_record", default=None)


def current_record() -> RequestRecord | None:
    """The record of the request being served; None outside the middleware (an app without it)."""
    return _record.get()


def note_model(model: str) -> None:
    """Hook for the answering routes: the requested model name (labelled only if it is an alias);
    admission starts here (its span ends where the answer's alias is noted)."""
    record = _record.get()
    if record is not None:
        record.model, record.admission_ns = model, time.time_ns()


class ObservabilityMiddleware:
    """Times each request, counts API requests by endpoint, alias and status, logs one line per request."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(self.metrics, time.perf_counter())
        token = _record.set(record)

        async def send_noting_status(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        with request_span() as span:
            try:
                await self.app(scope, receive, send_noting_status)
            except BaseException:
                record.status, record.error = record.status or 500, record.error or "internal_error"
                raise
            finally:
                _record.reset(token)
                finish_request(span, record, self._finish(scope, record), time.time_ns())

    def _finish(self, scope, record: RequestRecord) -> dict[str, Any]:
        """Count and log the request; returns its log line's fields."""
        path, method, status = scope["path"], scope["method"], record.status or 500
        fields: dict[str, Any] = {"method": method, "path": path, "status": status,
                                  "duration_ms": round((time.perf_counter() - record.started) * 1000, 1)}
        endpoint = api_endpoint(scope)
        if endpoint is not None:
            alias = self._alias_label(scope, record)
            self._count(endpoint, method, alias, f"{status // 100}xx", record.error)
            fields.update(endpoint=endpoint, alias=alias, tenant=record.tenant, error=record.error, **record.summary)
            if record.ttft_s is not None:
                fields["ttft_ms"] = round(record.ttft_s * 1000, 1)
        level = logging.DEBUG if path.startswith(QUIET_PATHS) else logging.INFO
        log.log(level, "%s %s %s", scope["method"], path, status, extra=fields)
        return fields

    def _count(self, endpoint: str, method: str, alias: str, status: str, error: str | None) -> None:
        m = self.metrics
        m.api_requests.labels(endpoint, method, alias, status).inc()
        if error is not None:
            m.api_errors.labels(endpoint, method, alias, error).inc()
        if endpoint == CHAT_ENDPOINT:
            m.requests.labels(alias, status).inc()
            if error is not None:
                m.errors.labels(alias, error).inc()

    def _alias_label(self, scope, record: RequestRecord) -> str:
        if record.alias is not None:
            return record.alias
        runtime = getattr(scope["app"].state, "runtime", None)
        aliases = runtime.aliases if runtime is not None else {}
        return record.model if record.model in aliases else UNKNOWN


def api_endpoint(scope) -> str | None:
    """The template of the API route a request matched (`/v1/responses/{response_id}`), or None:
    for /metrics, /health/ and the playground, a path no route matched, or a method its route does
    not serve (so no label holds a path or a method name a client made up)."""
    route = scope.get("route")  # set by the router as it matches, on this same scope
    template = getattr(route, "path", "")
    if template.startswith(API_PREFIXES) and scope["method"] in getattr(route, "methods", ()):
        return template
    return None
