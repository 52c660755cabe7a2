"""Command line: `python -m gateway serve|fetch-models|check-config`. The only place that reads argv."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from adapters.local_model import LocalModelError
from adapters.model_files import CATALOG, ModelFileError, resolve_model
from adapters.upstream_server import UpstreamServerError
from gateway.settings import SettingsError, load_settings

STARTUP_ERRORS = (SettingsError, ModelFileError, LocalModelError, UpstreamServerError)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return args.run(args)
    except STARTUP_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(required=True)
    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", default="config.yaml", help="YAML settings file (default: config.yaml)")
    serve.set_defaults(run=_serve)
    fetch = commands.add_parser("fetch-models", help="fetch, assemble and verify catalog models")
    fetch.add_argument("names", nargs="*", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"],
                       help=f"catalog names: {', '.join(CATALOG)}")
    fetch.set_defaults(run=_fetch)
    check = commands.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", default="config.yaml")
    check.set_defaults(run=lambda a: (load_settings(a.config), print("config ok"))[0] or 0)
    return parser


def _fetch(args: argparse.Namespace) -> int:
    for name in args.names:
        print(f"{name}: {resolve_model(name, fetch=True)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    return asyncio.run(_serve_async(settings))


async def _serve_async(settings) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.runtime import Runtime

    runtime = await Runtime.start(settings)  # fail here, with one line, before binding the port

    async def reuse(_settings):
        return runtime

    app = create_app(settings, start_runtime=reuse)
    config = uvicorn.Config(
        app, host=settings.server.host, port=settings.server.port, log_level="info",
        timeout_graceful_shutdown=int(settings.server.drain_seconds), access_log=False,
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        await runtime.close()  # idempotent: the app's lifespan normally closed it already
    return 0


if __name__ == "__main__":
    sys.exit(main())
