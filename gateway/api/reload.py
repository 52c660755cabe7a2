"""POST /admin/reload: re-read the configuration file and serve it without a restart (the admin key
only), as SIGHUP does (gateway/__main__.py); gateway.runtime.Runtime.reload says what changes."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.api.routes import require_admin, runtime_of
from gateway.settings import SettingsError
from gateway.wire.errors import InvalidRequest

router = APIRouter()


class ConfigurationRefused(InvalidRequest):
    """The file failed the checks start-up makes: nothing of it is served."""

    code = "invalid_configuration"


@router.post("/admin/reload")
async def reload_configuration(request: Request) -> dict:
    """Reload the configuration: 200 with the aliases now served and the checks' warnings, or 400
    with the check's message while the running configuration keeps serving."""
    require_admin(request)
    runtime = runtime_of(request)
    try:
        warnings = await runtime.reload()
    except SettingsError as exc:
        raise ConfigurationRefused(f"configuration not reloaded, the running one keeps serving: {exc}") from exc
    return {"reloaded": True, "aliases": sorted(runtime.aliases), "warnings": warnings}
