"""Command line: `python -m gateway serve|fetch-models|check-config|tune|steer`. The only place that reads argv."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from adapters.local_model import LocalModelError
from adapters.model_files import CATALOG, ModelFileError, resolve_model
from adapters.upstream_server import UpstreamServerError
from fitting.cli import register as fitting_commands  # the composition root: only it imports fitting/
from gateway.logs import configure_logging
from gateway.settings import ServerSettings, Settings, SettingsError, load_settings
from policies.learned import RouterError

if TYPE_CHECKING:
    import uvicorn

    from gateway.runtime import Runtime

STARTUP_ERRORS = (SettingsError, ModelFileError, LocalModelError, UpstreamServerError, RouterError)
log = logging.getLogger("gateway")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return args.run(args)
    except STARTUP_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="json", choices=["json", "text"],
                        help="json: one object per line with the request id (default); text: for a terminal")
    commands = parser.add_subparsers(required=True)
    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", default="config.yaml", help="YAML settings file (default: config.yaml)")
    serve.set_defaults(run=_serve)
    fetch = commands.add_parser("fetch-models", help="fetch, assemble and verify catalog models")
    fetch.add_argument("names", nargs="*", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"],
                       help=f"catalog names: {', '.join(CATALOG)}")
    fetch.set_defaults(run=_fetch)
    check = commands.add_parser("check-config", help="check a config file as start-up would, without loading models")
    check.add_argument("--config", default="config.yaml")
    check.set_defaults(run=_check_config)
    fitting_commands(commands)  # tune, steer (fitting/: the one package above the gateway's own layers)
    return parser


def _check_config(args: argparse.Namespace) -> int:
    from gateway.config_checks import check_settings

    settings = load_settings(args.config)
    checked = check_settings(settings)  # what start-up (and a reload) checks before loading a model
    for line in checked.notes:
        print(f"note: {line}", file=sys.stderr)
    for warning in checked.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"config ok: aliases {', '.join(settings.aliases)}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    for name in args.names:
        print(f"{name}: {resolve_model(name, fetch=True)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    return asyncio.run(_serve_async(settings, args.log_level, lambda: load_settings(args.config)))


async def _serve_async(settings: Settings, log_level: str, reread: Callable[[], Settings] | None = None) -> int:
    import uvicorn

    from gateway import observability
    from gateway.api.app import create_app
    from gateway.observability.tracing_provider import start_tracing
    from gateway.runtime import Runtime

    tracing = start_tracing(settings.tracing)
    metrics = observability.Metrics()
    # fail here, with one line, before binding the port
    runtime = await Runtime.start(settings, observe_calls=observability.metered_calls(metrics), load_settings=reread)

    async def reuse(_settings):
        return runtime

    app = create_app(settings, start_runtime=reuse, metrics=metrics)
    asyncio.get_running_loop().add_signal_handler(  # the task is kept, and cancelled at close, with the runtime's
        signal.SIGHUP, lambda: runtime.background.append(asyncio.ensure_future(reload_logged(runtime))))
    try:
        await uvicorn.Server(uvicorn_config(app, settings.server, log_level)).serve()
    finally:
        await runtime.close()  # idempotent: the app's lifespan normally closed it already
        if tracing is not None:
            tracing.shutdown()  # sends the spans still batched
    return 0


async def reload_logged(runtime: Runtime) -> None:
    """SIGHUP: reload the configuration file (Runtime.reload), logging the outcome; a file that fails
    its checks is logged and the running configuration keeps serving."""
    try:
        lines = await runtime.reload()
    except SettingsError as exc:
        log.error("configuration reload refused, the running configuration keeps serving: %s", exc)
        return
    except Exception:  # noqa: BLE001 - a signal handler's task: log it, the running configuration serves on
        log.exception("configuration reload failed, the running configuration keeps serving")
        return
    for line in lines:
        log.warning("%s", line)
    log.info("configuration reloaded: aliases %s", ", ".join(runtime.aliases))


def uvicorn_config(app, server: ServerSettings, log_level: str) -> uvicorn.Config:
    """uvicorn's settings for serving `app` as `server` says, its HTTP protocol bounded by
    `server.header_timeout_s` (see HeaderDeadline)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    protocol = type("GatewayHTTPProtocol", (HeaderDeadline, AutoHTTPProtocol),
                    {"header_timeout_s": server.header_timeout_s})
    return uvicorn.Config(
        app, host=server.host, port=server.port, log_level=log_level, http=protocol,
        timeout_graceful_shutdown=int(server.drain_seconds), access_log=False,
        log_config=None,  # uvicorn's lines go through our handler: JSON, with request ids
    )


class HeaderDeadline:
    """Mixed into uvicorn's HTTP protocol (h11's or httptools'): closes a connection whose next
    request line and headers have not all arrived `header_timeout_s` after it opened or after its
    previous answer ended. uvicorn has no such limit (its keep-alive time-out ends at the first
    byte), so a client could hold a connection (a file descriptor and its buffers) for ever by
    sending nothing, or a header a byte at a time, or a body nobody reads."""

    header_timeout_s: float
    _deadline: asyncio.TimerHandle | None = None
    _previous_cycle = None  # uvicorn's request cycle when the deadline was set: a new one means headers arrived

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._stop_if_headers_arrived()

    def on_response_complete(self) -> None:
        self._await_headers()  # first: uvicorn reads a pipelined request's headers within the call
        super().on_response_complete()
        self._stop_if_headers_arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop()
        self._previous_cycle = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expire)

    def _stop_if_headers_arrived(self) -> None:
        if self.cycle is not self._previous_cycle:
            self._stop()

    def _stop(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.debug("closing a connection whose request headers took over %g s", self.header_timeout_s)
            self.transport.close()


if __name__ == "__main__":
    sys.exit(main())
