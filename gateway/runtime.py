"""Everything a running gateway holds, built from Settings at start-up and closed at shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from adapters.litellm_client import litellm
from adapters.local_model import LocalModel, system_info
from adapters.memory_store import MemoryStore
from adapters.model_files import model_sha256, resolve_model
from adapters.redis_store import RedisStore
from adapters.steering import Steering, SteeringError, SteeringVector
from adapters.store import Store
from adapters.upstream import Continuations, Upstream, prices_of
from adapters.upstream_server import UpstreamServer
from adapters.vocabulary import Vocabulary
from gateway.presets import FALLBACKS, PRESETS, ROUTER
from gateway.settings import AliasSettings, RoutingOverride, RoutingSettings, Settings, SettingsError, UpstreamSettings
from gateway.shadow.service import Shadow
from gateway.tenancy.budget import Ledger
from gateway.tenancy.routing import policy_of, resolve_routing
from gateway.tenancy.tenants import TenantDirectory
from gateway.wire.errors import InvalidRequest
from policies import Router, SharedWindows
from policies.answer_check import AnswerCheck
from policies.learned import RouterError

log = logging.getLogger("gateway.runtime")


@dataclass(frozen=True)
class Alias:
    """A served model name: a local model, an optional upstream and a default routing."""

    name: str
    local: LocalModel
    upstream: Upstream | None  # the upstream itself: requests passed through whole call it
    settings: AliasSettings
    router: Router | None = None  # the learned policy's router, trained for this alias's local model
    answer_check: AnswerCheck | None = None  # rates finished answers (escalate_below), fitted for its local model
    # the recent values that thresholds calibrate on (policies.window), one set per tenant
    tenant_windows: dict[str, SharedWindows] = field(default_factory=dict)
    continuations: Continuations | None = None  # what the decoder hands off to: the upstream, metered

    def __post_init__(self) -> None:
        if self.continuations is None:
            object.__setattr__(self, "continuations", self.upstream)

    @property
    def priced(self) -> bool:
        """False only for an upstream without prices, where the price rule never escalates a draft."""
        return self.upstream is None or not self.upstream.prices.free

    def windows(self, tenant: str) -> SharedWindows:
        """`tenant`'s windows of recent values on this alias (tenants are configured: bounded)."""
        return self.tenant_windows.setdefault(tenant, SharedWindows())


@dataclass
class Runtime:
    settings: Settings
    tenants: TenantDirectory
    ledger: Ledger
    aliases: dict[str, Alias] = field(default_factory=dict)
    local_models: dict[str, LocalModel] = field(default_factory=dict)
    servers: list[UpstreamServer] = field(default_factory=list)
    background: list[asyncio.Task] = field(default_factory=list)  # ledger flusher, child supervisors
    closed: bool = False
    shadow: Shadow | None = None  # shadow answers and quality targets (gateway/shadow/), if an alias has them

    @classmethod
    async def start(cls, settings: Settings, environ: Mapping[str, str] | None = None) -> "Runtime":
        """Load models, start loopback upstream servers, connect the store.

        Raises ModelFileError, LocalModelError, UpstreamServerError, RouterError or SettingsError
        (one-line messages); a Redis that does not answer is not an error: the gateway starts local-only.
        """
        environ = os.environ if environ is None else environ
        litellm()  # configured once, here, rather than by whichever request first calls an upstream
        tenants = TenantDirectory(settings.tenants, environ, settings.admin_key_env)
        runtime = cls(settings, tenants, Ledger(_store(settings)))
        try:
            await runtime._load(settings)
        except BaseException:
            await runtime.close()
            raise
        runtime.background.append(asyncio.create_task(runtime.ledger.keep_flushing()))
        runtime.background.extend(asyncio.create_task(server.supervise()) for server in runtime.servers)
        if runtime.shadow is not None:
            runtime.background.extend(asyncio.create_task(work) for work in runtime.shadow.tasks())
        return runtime

    async def _load(self, settings: Settings) -> None:
        if "AMX" in system_info():
            log.warning("this llama.cpp build uses AMX kernels, which crash where the kernel does not grant "
                        "AMX tiles; scripts/setup.sh builds without them")
        for line in fit_presets(settings):
            log.warning("%s", line)
        files = alias_files(settings)  # checked before models load, which takes a while
        for warning in check_routing(settings, {name: router for name, (router, _) in files.items()}):
            log.warning("%s", warning)
        steerings = steering_of(settings)
        for name, local in settings.models.local.items():
            path = resolve_model(local.gguf)
            self.local_models[name] = await LocalModel.load(
                path, local.n_ctx, local.n_threads, local.n_batch, settings.server.queue_limit, local.parallel,
                look_ahead=local.look_ahead, flash_attn=local.flash_attn, steering=steerings.get(name))
        upstreams = {name: await self._upstream(name, up) for name, up in settings.upstreams.items()}
        for name, alias in settings.aliases.items():
            upstream = upstreams[alias.upstream] if alias.upstream else None
            self.aliases[name] = Alias(name, self.local_models[alias.local], upstream, alias, *files[name])
        self.shadow = Shadow.of(settings, self.aliases, self.ledger)
        if not await self.ledger.store.ping():
            host = settings.store.url.rsplit("@", 1)[-1]  # never log a password
            log.warning("store at %s does not answer: serving local-only until it does", host)

    async def _upstream(self, name: str, settings: UpstreamSettings) -> Upstream:
        if settings.launch is not None:
            launch = settings.launch
            isolated = launch.server == "llama-server" and settings.cache_isolation == "tenant"
            server = UpstreamServer(resolve_model(launch.gguf), launch, name, isolated=isolated)
            self.servers.append(server)
            await server.wait_ready()
            update: dict = {"api_base": server.api_base}
            if launch.server == "llama-server":
                update.update(kind="llama-server", slots=launch.parallel)
            else:
                update.update(kind="llama-cpp-python")
            settings = settings.model_copy(update=update)
        return make_upstream(name, settings, self.ledger.store)

    def routing_of(self, alias: Alias) -> RoutingSettings:
        """The alias's routing as a request starts from it: its quality target's knob, if any, at the
        value the controller holds now (tenant and request overrides still apply on top)."""
        routing = alias.settings.routing
        return self.shadow.routing_of(alias.name, routing) if self.shadow is not None else routing

    async def close(self) -> None:
        """Stop child servers, free models, close the store. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        for server in self.servers:
            server.stop()
        for model in self.local_models.values():
            model.close()
        await self.ledger.store.close()


def make_upstream(name: str, settings: UpstreamSettings, store: Store | None = None) -> Upstream:
    """An Upstream whose prompts are rendered (and tokens counted) with its own GGUF's vocabulary,
    leasing a llama-server's slots through `store` (the runtime's, shared by replicas)."""
    template_ref = settings.template_gguf or (settings.launch.gguf if settings.launch else None)
    vocab = Vocabulary(resolve_model(template_ref)) if template_ref else None
    return Upstream(name, settings, vocab, store)


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
        local_sha = model_sha256(local.gguf) if needs_sha else ""  # hashing a model given by path takes a while
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
        problem = _routing_problem(alias.routing, None, routers[name], priced)
        if problem:
            raise SettingsError(f"aliases.{name}: {problem}")
        for tenant in settings.tenants:
            if tenant.routing is None or not tenant.may_use(name):
                continue
            problem = _routing_problem(alias.routing, tenant.routing, routers[name], priced)
            if problem:
                warnings.append(f"tenants.{tenant.id} on alias {name}: requests without routing of their own "
                                f"get a 400: {problem}")
    return warnings


def _routing_problem(routing: RoutingSettings, override: RoutingOverride | None, router: Router | None,
                     priced: bool) -> str | None:
    """Why a request under `override` and no routing of its own is refused (None: it is not)."""
    try:
        policy_of(resolve_routing(routing, override, priced=priced), router, SharedWindows())
    except InvalidRequest as exc:
        return exc.message
    return None


def _store(settings: Settings) -> Store:
    s = settings.store
    if s.backend == "redis":
        return RedisStore(s.url, s.key_prefix, s.timeout_s, s.reservation_ttl_s, s.cache_ttl_s, s.cache_max_entries,
                          cluster=s.cluster, max_memory_fraction=s.max_memory_fraction)
    return MemoryStore(reservation_ttl_s=s.reservation_ttl_s, cache_ttl_s=s.cache_ttl_s,
                       cache_max_entries=s.cache_max_entries, responses_max_entries=s.responses_max_entries,
                       max_bytes=s.memory_max_bytes)
