"""The checks a configuration passes before a model loads: at start-up, in `python -m gateway
check-config`, and in a reload (gateway.runtime.Runtime.reload). Each raises a one-line error
naming the key, or returns the lines worth a warning."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from adapters.continuation_modes import gives_alternatives
from adapters.model_files import model_sha256, resolve_model
from adapters.steering import Steering, SteeringError, SteeringVector
from adapters.upstream import prices_of
from gateway.presets import FALLBACKS, PRESETS, ROUTER
from gateway.settings import RoutingOverride, RoutingSettings, Settings, SettingsError
from gateway.tenancy.routing import policy_of, resolve_routing
from gateway.wire.errors import InvalidRequest
from policies import Router, SharedWindows
from policies.answer_check import AnswerCheck
from policies.learned import RouterError


@dataclass(frozen=True)
class CheckedSettings:
    """Settings that passed start-up's checks, with what the checks read."""

    settings: Settings
    files: dict[str, tuple[Router | None, AnswerCheck | None]]  # each alias's router and answer check
    steerings: dict[str, Steering]  # each steered local entry's vector
    notes: list[str]  # presets that fell back (fit_presets)
    warnings: list[str]  # tenant overrides under which an alias refuses requests (check_routing)


def check_settings(settings: Settings) -> CheckedSettings:
    """Check `settings` as start-up does before loading a model (and `python -m gateway check-config`,
    and a reload): every local model file there (a catalog one verified, not fetched), steering vectors,
    presets fitted (in place), routers and answer checks fitted for their models, each alias's routing
    runnable. Raises SettingsError, ModelFileError or RouterError, each one line."""
    for local in settings.models.local.values():
        resolve_model(local.gguf)
    steerings = steering_of(settings)  # its width is checked as the model loads
    notes = fit_presets(settings)
    files = alias_files(settings)
    warnings = check_routing(settings, {name: router for name, (router, _) in files.items()})
    return CheckedSettings(settings, files, steerings, notes, warnings)


def fit_presets(settings: Settings) -> list[str]:
    """Give each alias whose routing preset needs a router fitted for another local model the
    preset's fallback (gateway/presets.py), in place; a line for each, saying what it lacks."""
    lines = []
    for name, alias in settings.aliases.items():
        routing = alias.routing
        if routing.preset is None or routing.router != ROUTER:
            continue
        try:
            Router.load(routing.router, model_sha256(settings.models.local[alias.local].gguf))
        except RouterError as exc:
            preset = PRESETS[routing.preset]  # the fields given beside it are those that differ from its values
            given = {k: v for k, v in routing.model_dump(exclude_unset=True).items() if preset.get(k, v) != v
                     or k not in preset}
            alias.routing = RoutingSettings(**{**FALLBACKS[routing.preset], **given, "preset": None})
            lines.append(f"alias '{name}': preset '{routing.preset}' has no router for its local model ({exc}); "
                         f"it falls back to {FALLBACKS[routing.preset]}")
    return lines


def steering_of(settings: Settings) -> dict[str, Steering]:
    """Each steered local entry's vector, checked against its GGUF's sha256 and its layers against
    the file's (its width against the model's as the model loads). Raises SettingsError naming the
    entry, or ModelFileError."""
    steerings = {}
    for name, local in settings.models.local.items():
        if local.steering is None:
            continue
        try:
            vector = SteeringVector.load(local.steering.vector, model_sha256(local.gguf))
            steerings[name] = Steering(vector, local.steering.scale, local.steering.layers)
            steerings[name].control(vector.n_layer, vector.n_embd)  # its layers exist
        except SteeringError as exc:
            raise SettingsError(f"models.local.{name}.steering: {exc}") from exc
    return steerings


def alias_files(settings: Settings) -> dict[str, tuple[Router | None, AnswerCheck | None]]:
    """Each alias's router and answer check, checked against its local model's sha256.
    Raises RouterError, or ModelFileError for a local model given by a path that is not there."""
    files = {}
    for name, alias in settings.aliases.items():
        routing, local = alias.routing, settings.models.local[alias.local]
        check_file = routing.answer_check if isinstance(routing.answer_check, str) else None
        needs_sha = routing.router is not None or check_file is not None
        local_sha = model_sha256(local.gguf) if needs_sha else ""
        files[name] = (None if routing.router is None else Router.load(routing.router, local_sha),
                       None if check_file is None else AnswerCheck.load(check_file, local_sha))
    return files


def check_routing(settings: Settings, routers: Mapping[str, Router | None]) -> list[str]:
    """Raise SettingsError for an alias whose own routing could never run (`routers`: each alias's
    router); return a warning for each tenant override under which an alias the tenant may use
    refuses (400) every request that brings no routing of its own (a request's `routing` may still
    complete it, so it does not stop the gateway)."""
    warnings = []
    for name, alias in settings.aliases.items():
        priced = alias.upstream is None or not prices_of(settings.upstreams[alias.upstream]).free
        upstream = None if alias.upstream is None else (alias.upstream, settings.upstreams[alias.upstream].mode)
        problem = _routing_problem(alias.routing, None, routers[name], priced, upstream)
        if problem:
            raise SettingsError(f"aliases.{name}: {problem}")
        for tenant in settings.tenants:
            if tenant.routing is None or not tenant.may_use(name):
                continue
            problem = _routing_problem(alias.routing, tenant.routing, routers[name], priced, upstream)
            if problem:
                warnings.append(f"tenants.{tenant.id} on alias {name}: requests without routing of their own "
                                f"get a 400: {problem}")
    return warnings


def _routing_problem(routing: RoutingSettings, override: RoutingOverride | None, router: Router | None,
                     priced: bool, upstream: tuple[str, str] | None = None) -> str | None:
    """Why a request under `override` and no routing of its own is refused (None: it is not);
    `upstream`: the alias's upstream and its mode, which a combine rule needs alternatives from."""
    try:
        resolved = resolve_routing(routing, override, priced=priced)
        policy_of(resolved, router, SharedWindows())
    except InvalidRequest as exc:
        return exc.message
    if resolved.combining.combines and upstream is not None and not gives_alternatives(upstream[1]):
        return (f"routing.combine '{resolved.combine}' needs the upstream's alternatives, and upstream "
                f"'{upstream[0]}' (mode {upstream[1]}) returns none: use take, or mode tokens, completions or "
                "chat_continue")
    return None
