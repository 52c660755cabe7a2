"""The app factory: `create_app(settings)` builds a FastAPI app; its lifespan owns the Runtime."""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway import observability
from gateway.api.admin import router as admin_router
from gateway.api.chat_completions import router as chat_router
from gateway.api.completions import router as completions_router
from gateway.api.playground import router as playground_router
from gateway.api.reload import router as reload_router
from gateway.api.responses_api import router as responses_router
from gateway.api.routes import router
from gateway.logs import request_id_var
from gateway.responses.request import ResponsesRequest
from gateway.runtime import Runtime
from gateway.settings import ServerSettings, Settings
from gateway.wire.errors import install_error_handlers
from gateway.wire.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("gateway")

RuntimeFactory = Callable[[Settings], Awaitable[Runtime]]


ROUTERS = (chat_router, responses_router, completions_router, router, playground_router, admin_router, reload_router)


def create_app(settings: Settings, start_runtime: RuntimeFactory | None = None,
               metrics: observability.Metrics | None = None) -> FastAPI:
    """A gateway app. Models load and child servers start in the lifespan, not here: by
    `start_runtime`, by default `Runtime.start` with each upstream call counted in `metrics` (the
    app's registry: a new one unless given, as when the caller started the runtime with its observer)."""
    metrics = metrics or observability.Metrics()  # a registry per app
    app = FastAPI(title="routing-gateway", version="0.1.0", lifespan=_lifespan(settings, start_runtime, metrics),
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json" if settings.server.docs else None)
    install_error_handlers(app)
    for routes in ROUTERS:
        app.include_router(routes)
    observability.install(app, metrics, settings.server.public_metrics)
    app.add_middleware(RequestIdMiddleware)  # outermost: the id is set for every log line below it
    app.openapi = lambda: app.openapi_schema or _openapi_with_request_bodies(app)
    return app


def _lifespan(settings: Settings, start_runtime: RuntimeFactory | None, metrics: observability.Metrics):
    """The app's lifespan: start the Runtime (`start_runtime`, else Runtime.start observed by
    `metrics`), serve, close it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = start_runtime or (lambda s: Runtime.start(s, observe_calls=observability.metered_calls(metrics)))
        app.state.runtime = await start(settings)
        metrics.runtime = app.state.runtime  # read by the scrape-time collectors
        log.info("gateway ready: aliases %s; open %s in a browser for the playground",
                 ", ".join(app.state.runtime.aliases), browser_url(settings.server))
        try:
            yield
        finally:
            await app.state.runtime.close()

    return lifespan


def browser_url(server: ServerSettings) -> str:
    """Where a browser on this machine reaches the gateway `server` describes (its root leads to the
    playground); a wildcard bind address is reached on loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(server.host, server.host)
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"http://{host}:{server.port}/"


PARSED_BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/responses": ResponsesRequest,
                 "/v1/completions": CompletionRequest}


def _openapi_with_request_bodies(app: FastAPI) -> dict:
    """FastAPI's description plus the request bodies that the routes parse themselves (to enforce
    the body-size limit and answer in OpenAI's error shape) and so do not declare."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    runtime = getattr(app.state, "runtime", None)
    for path, model in PARSED_BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        if runtime is not None:  # the served model names: clients and fuzzers see which `model` values exist
            body["properties"]["model"]["enum"] = sorted(runtime.aliases)
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    app.openapi_schema = schema
    return schema


REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")  # what a client's id may hold to be echoed and logged


class RequestIdMiddleware:
    """Gives every response an `x-request-id`: the client's if it sent one of up to 64 letters, digits
    and `._:-` (anything else could forge log lines or a terminal's escapes), else a fresh one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(b"x-request-id", b"")
        request_id = incoming if REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", request_id)]
            await send(message)

        token = request_id_var.set(request_id.decode("latin-1"))
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
