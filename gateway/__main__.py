"""Command line: `python -m gateway serve|fetch-models|check-config`. The only place that reads argv."""

from __future__ import annotations

import argparse
import asyncio
import sys

from adapters.local_model import LocalModelError
from adapters.model_files import CATALOG, ModelFileError, resolve_model
from adapters.upstream_server import UpstreamServerError
from gateway.observability import configure_logging
from gateway.settings import SettingsError, load_settings
from policies.learned import RouterError

STARTUP_ERRORS = (SettingsError, ModelFileError, LocalModelError, UpstreamServerError, RouterError)


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
    return parser


def _check_config(args: argparse.Namespace) -> int:
    from gateway.runtime import alias_files, check_routing

    settings = load_settings(args.config)
    for local in settings.models.local.values():
        resolve_model(local.gguf)  # there, and a catalog model verified, as start-up needs it (not fetched)
    routers = {name: router for name, (router, _) in alias_files(settings).items()}
    for warning in check_routing(settings, routers):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"config ok: aliases {', '.join(settings.aliases)}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    for name in args.names:
        print(f"{name}: {resolve_model(name, fetch=True)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    return asyncio.run(_serve_async(settings, args.log_level))


async def _serve_async(settings, log_level: str) -> int:
    import uvicorn

    from gateway.api.app import create_app
    from gateway.runtime import Runtime

    runtime = await Runtime.start(settings)  # fail here, with one line, before binding the port

    async def reuse(_settings):
        return runtime

    app = create_app(settings, start_runtime=reuse)
    config = uvicorn.Config(
        app, host=settings.server.host, port=settings.server.port, log_level=log_level,
        timeout_graceful_shutdown=int(settings.server.drain_seconds), access_log=False,
        log_config=None,  # uvicorn's lines go through our handler: JSON, with request ids
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        await runtime.close()  # idempotent: the app's lifespan normally closed it already
    return 0


if __name__ == "__main__":
    sys.exit(main())
