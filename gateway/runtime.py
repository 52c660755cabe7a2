"""Everything a running gateway holds, built from Settings at start-up and closed at shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from adapters.litellm_client import litellm
from adapters.local_model import LocalModel, LocalModelError, system_info
from adapters.memory_store import MemoryStore
from adapters.model_files import ModelFileError, resolve_model
from adapters.redis_store import RedisStore
from adapters.store import Store
from adapters.upstream import Continuations, Upstream
from adapters.upstream_server import UpstreamServer
from adapters.vocabulary import Vocabulary
from gateway.config_checks import CheckedSettings, check_settings
from gateway.settings import (AliasSettings, RoutingSettings, Settings, SettingsError, TenantSettings,
                              UpstreamSettings)
from gateway.shadow.service import Shadow
from gateway.tenancy.budget import Ledger
from gateway.tenancy.tenants import TenantDirectory
from policies import Router, SharedWindows
from policies.answer_check import AnswerCheck

log = logging.getLogger("gateway.runtime")
RETIRE_POLL_S = 1.0  # how often a model a reload dropped is checked for requests still on it
# What a reload turns into a 400 (SettingsError): the adapters' one-line errors about a file or a setting
# (a router, steering vector or template of another model, an upstream mode its model cannot serve).
RELOAD_REFUSALS = (ModelFileError, LocalModelError, ValueError)
# What the runtime builds an alias's continuations with: (alias name, its upstream) -> the upstream
# as the alias's decoder calls it (gateway.observability.metered_calls: counted, timed and traced).
UpstreamObserver = Callable[[str, Upstream], Continuations]
# Branches a reload keeps as they run: they change only with a restart (docs/deployment.md).
RESTART_ONLY = ("server", "store", "tenants", "admin_key_env", "tracing")


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
class ModelHold:
    """One request counted on the local model it was admitted on (`Runtime.hold`), from the moment
    admission picks its alias until `give_back` (once; safe to repeat)."""

    holds: Counter[LocalModel]
    model: LocalModel
    given_back: bool = False

    def give_back(self) -> None:
        if not self.given_back:
            self.given_back = True
            self.holds[self.model] -= 1
            if self.holds[self.model] <= 0:
                del self.holds[self.model]


@dataclass
class Runtime:
    settings: Settings
    tenants: TenantDirectory
    ledger: Ledger
    aliases: dict[str, Alias] = field(default_factory=dict)
    local_models: dict[str, LocalModel] = field(default_factory=dict)
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    observe_calls: UpstreamObserver | None = None  # wraps each alias's upstream for its decoder
    load_settings: Callable[[], Settings] | None = None  # re-reads the configuration file, for `reload`
    models_by_settings: dict[str, LocalModel] = field(default_factory=dict)  # every model loaded, by its entry JSON
    holds: Counter[LocalModel] = field(default_factory=Counter)  # requests admitted on each model, not yet ended
    servers: list[UpstreamServer] = field(default_factory=list)
    background: list[asyncio.Task] = field(default_factory=list)  # ledger flusher, child supervisors
    closed: bool = False
    shadow: Shadow | None = None  # shadow answers and quality targets (gateway/shadow/), if an alias has them
    shadow_tasks: list[asyncio.Task] = field(default_factory=list)  # the shadow service's workers
    _reloading: asyncio.Lock = field(default_factory=asyncio.Lock)  # one reload at a time

    @classmethod
    async def start(cls, settings: Settings, environ: Mapping[str, str] | None = None,
                    observe_calls: UpstreamObserver | None = None,
                    load_settings: Callable[[], Settings] | None = None) -> "Runtime":
        """Load models, start loopback upstream servers, connect the store; each alias's decoder calls
        its upstream through `observe_calls(alias, upstream)`; `reload` re-reads `load_settings()`.

        Raises ModelFileError, LocalModelError, UpstreamServerError, RouterError or SettingsError
        (one-line messages); a Redis that does not answer is not an error: the gateway starts local-only.
        """
        environ = os.environ if environ is None else environ
        litellm()  # configured once, here, rather than by whichever request first calls an upstream
        tenants = TenantDirectory(settings.tenants, environ, settings.admin_key_env)
        runtime = cls(settings, tenants, Ledger(_store(settings)), observe_calls=observe_calls,
                      load_settings=load_settings)
        try:
            await runtime._load(settings)
        except BaseException:
            await runtime.close()
            raise
        runtime.background.append(asyncio.create_task(runtime.ledger.keep_flushing()))
        runtime.background.append(asyncio.create_task(tenants.keep_current(runtime.ledger.store)))
        runtime.background.extend(asyncio.create_task(server.supervise()) for server in runtime.servers)
        runtime._restart_shadow(runtime.shadow)
        return runtime

    async def _load(self, settings: Settings) -> None:
        if "AMX" in system_info():
            log.warning("this llama.cpp build uses AMX kernels, which crash where the kernel does not grant "
                        "AMX tiles; scripts/setup.sh builds without them")
        checked = check_settings(settings)  # before models load, which takes a while
        for line in checked.notes + checked.warnings:
            log.warning("%s", line)
        self.local_models, _ = await self._local_models(checked)
        self.upstreams = {name: await self._upstream(name, up) for name, up in settings.upstreams.items()}
        self.aliases = self._aliases(checked, self.local_models, self.upstreams)
        self.shadow = await asyncio.to_thread(self._shadow_of, settings, self.aliases)
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

    async def _local_models(self, checked: CheckedSettings) -> tuple[dict[str, LocalModel], dict[str, LocalModel]]:
        """Each local entry's model: one already loaded with the same settings, else loaded now; and
        those loaded now, by entry name. A failure frees those this call loaded."""
        models: dict[str, LocalModel] = {}
        fresh: dict[str, LocalModel] = {}
        try:
            for name, local in checked.settings.models.local.items():
                key = local.model_dump_json()
                if key not in self.models_by_settings:
                    fresh[name] = self.models_by_settings[key] = await LocalModel.load(
                        resolve_model(local.gguf), local.n_ctx, local.n_threads, local.n_batch,
                        checked.settings.server.queue_limit, local.parallel, look_ahead=local.look_ahead,
                        flash_attn=local.flash_attn, steering=checked.steerings.get(name))
                models[name] = self.models_by_settings[key]
        except BaseException:
            await self._unload(fresh.values())
            raise
        return models, fresh

    async def _unload(self, models: Iterable[LocalModel]) -> None:
        """Free `models`: loaded for a configuration that is not served, dropped by one, or all at shutdown;
        each once no call on it is in flight on any thread (LocalModel.close waits, off the event loop)."""
        for model in list(models):
            self.models_by_settings = {key: kept for key, kept in self.models_by_settings.items() if kept is not model}
            await asyncio.to_thread(model.close)  # frees the weights: tens of milliseconds and more

    def _aliases(self, checked: CheckedSettings, local_models: Mapping[str, LocalModel],
                 upstreams: Mapping[str, Upstream]) -> dict[str, Alias]:
        """The aliases of `checked`; one whose model and routing did not change keeps its windows of
        recent values (what its thresholds are calibrated on)."""
        aliases = {}
        for name, alias in checked.settings.aliases.items():
            upstream, local = upstreams[alias.upstream] if alias.upstream else None, local_models[alias.local]
            running = self.aliases.get(name)
            same = running is not None and running.local is local and running.settings.routing == alias.routing
            observed = self.observe_calls(name, upstream) if upstream and self.observe_calls else upstream
            aliases[name] = Alias(name, local, upstream, alias, *checked.files[name], continuations=observed,
                                  tenant_windows=running.tenant_windows if same else {})
        return aliases

    def _shadow_of(self, settings: Settings, aliases: dict[str, Alias]) -> Shadow | None:
        """The shadow service of `settings` over `aliases` (Shadow.of), taking over from the running
        one what its unchanged aliases learned, and counting the tenants of the directory as it is
        at each refresh (the admin API's too). Blocking: it may hash a GGUF."""
        return Shadow.of(settings, aliases, self.ledger, running=self.shadow, tenants=self._tenant_settings)

    def _tenant_settings(self) -> list[TenantSettings]:
        """The settings of every tenant the directory holds now (config.yaml's and the admin API's)."""
        return [tenant.settings for tenant in self.tenants.by_id.values()]

    async def reload(self) -> list[str]:
        """Re-read the configuration and serve its aliases, routing and upstreams (prices, limits),
        checked as at start-up; the branches in RESTART_ONLY stay as they run. A request admitted
        before keeps the alias it was admitted on to its end, and its local model is freed only once
        the request has ended; a local model loads only for an entry that is new or changed. Returns
        the notes and warnings; raises SettingsError with one line (a bad file is refused whole, what
        it loaded is freed) and the running configuration keeps serving."""
        if self.load_settings is None:
            raise SettingsError("this gateway was not started from a configuration file: nothing to re-read")
        async with self._reloading:
            try:
                return await self._reload()
            except RELOAD_REFUSALS as exc:
                raise SettingsError(str(exc)) from exc

    async def _reload(self) -> list[str]:
        """`reload`'s work, every blocking step (reading, hashing, loading files) off the event loop."""
        settings, notes = kept_as_running(self.settings, await asyncio.to_thread(self.load_settings))
        if settings.shadow.operator in self.tenants.by_id:  # its ledger would be that tenant's
            raise SettingsError(f"shadow.operator: '{settings.shadow.operator}' is a tenant's id (created through "
                                "the admin API); the shadow budget needs an id of its own")
        checked = await asyncio.to_thread(check_settings, settings)
        upstreams = await self._reloaded_upstreams(settings)  # refuses a launch change before any model loads
        local_models, fresh = await self._local_models(checked)
        try:
            aliases = self._aliases(checked, local_models, upstreams)
            shadow = await asyncio.to_thread(self._shadow_of, settings, aliases)
        except BaseException:
            await self._unload(fresh.values())
            raise
        self._serve(settings, local_models, upstreams, aliases, shadow)
        return notes + [f"models.local.{name}: loaded" for name in fresh] + checked.notes + checked.warnings

    async def _reloaded_upstreams(self, settings: Settings) -> dict[str, Upstream]:
        """Each upstream of `settings`: the running one where its settings did not change, else built
        anew (a launched one on the server already running). Raises SettingsError for a new or
        changed `launch`: a child server starts only with the gateway."""
        upstreams = {}
        for name, configured in settings.upstreams.items():
            running = self.settings.upstreams.get(name)
            if configured == running:
                upstreams[name] = self.upstreams[name]
                continue
            if configured.launch != (running.launch if running else None):
                raise SettingsError(f"upstreams.{name}.launch: a launched server starts and changes only with a "
                                    "restart of the gateway")
            if configured.launch is not None:  # same server: its address, kind and slots as found at start-up
                served = self.upstreams[name].settings
                configured = configured.model_copy(update={"api_base": served.api_base, "kind": served.kind,
                                                           "slots": served.slots})
            vocab = await asyncio.to_thread(vocabulary_of, configured)  # reads a GGUF
            upstreams[name] = Upstream(name, configured, vocab, self.ledger.store)
        return upstreams

    def _serve(self, settings: Settings, local_models: dict[str, LocalModel], upstreams: dict[str, Upstream],
               aliases: dict[str, Alias], shadow: Shadow | None) -> None:
        """Serve a reloaded configuration in place of the running one, in one step (no await): an alias
        lookup finds every alias old or every alias new. A request already admitted keeps its Alias
        (model, upstream, routing, files) to its end; what `routing_of` adds (a knob's value) it reads
        from the shadow service current when it starts, the new one if this reload came in between.
        The models no longer named are freed once no request admitted on them is left (`_retire`)."""
        named = {id(model) for model in local_models.values()}
        dropped = {id(model): model for model in self.local_models.values() if id(model) not in named}.values()
        self.settings, self.local_models, self.upstreams, self.aliases = settings, local_models, upstreams, aliases
        self.background = [task for task in self.background if not task.done()]  # ended ones hold old services
        self._restart_shadow(shadow)
        self.background.extend(asyncio.create_task(self._retire(model)) for model in dropped)

    def _restart_shadow(self, shadow: Shadow | None) -> None:
        """Serve `shadow` in place of the running service, whose workers stop; `shadow.tasks()` takes
        over what they leave (Shadow.of's `running`); with no service after it, its pending counts
        are written once more."""
        if self.shadow is not None:
            for task in self.shadow_tasks:
                task.cancel()
            if shadow is None:
                self.background.append(asyncio.create_task(self.shadow.sync()))
        self.shadow, self.shadow_tasks = shadow, []
        if shadow is not None:
            self.shadow_tasks = [asyncio.create_task(work) for work in shadow.tasks()]
            self.background.extend(self.shadow_tasks)

    def hold(self, model: LocalModel) -> ModelHold:
        """Count a request on `model`, the local model of the alias admission picked for it, until the
        hold is given back (when the request's admission resources are released): a reload frees no
        model that a request holds. A cancelled request gives its hold back as it unwinds, while a
        worker thread of its may still run a call on the model: the model counts those itself
        (LocalModel.close frees it only once none is left)."""
        self.holds[model] += 1
        return ModelHold(self.holds, model)

    async def _retire(self, model: LocalModel) -> None:
        """Free a model a reload dropped once no request admitted on it is left: none holds it (`hold`:
        from its alias lookup to its end) and none of its sequences is held or awaited; the free itself
        waits for any call a cancelled request's thread still runs on it (`_unload`)."""
        while self.holds[model] or model.queue_depth or self._reloading.locked():  # a reload may pick it again
            await asyncio.sleep(RETIRE_POLL_S)
        if any(served is model for served in self.local_models.values()):
            return  # a later reload named its settings again: it serves on
        await self._unload([model])

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
        await self._unload(self.models_by_settings.values())
        await self.ledger.store.close()


def kept_as_running(running: Settings, read: Settings) -> tuple[Settings, list[str]]:
    """`read` with the RESTART_ONLY branches as they run, and a note for each that the file changed."""
    changed = [name for name in RESTART_ONLY if getattr(read, name) != getattr(running, name)]
    notes = [f"{name}: changed in the file, kept as running until a restart" for name in changed]
    return read.model_copy(update={name: getattr(running, name) for name in RESTART_ONLY}), notes


def make_upstream(name: str, settings: UpstreamSettings, store: Store | None = None) -> Upstream:
    """An Upstream whose prompts are rendered (and tokens counted) with its own GGUF's vocabulary,
    leasing a llama-server's slots through `store` (the runtime's, shared by replicas)."""
    return Upstream(name, settings, vocabulary_of(settings), store)


def vocabulary_of(settings: UpstreamSettings) -> Vocabulary | None:
    """The upstream's own vocabulary and chat template (`template_gguf`, else its launched GGUF), if
    known. Blocking: it reads the GGUF. Raises ModelFileError, or ValueError for a file llama.cpp refuses."""
    template_ref = settings.template_gguf or (settings.launch.gguf if settings.launch else None)
    return Vocabulary(resolve_model(template_ref)) if template_ref else None


def _store(settings: Settings) -> Store:
    s = settings.store
    if s.backend == "redis":
        return RedisStore(s.url, s.key_prefix, s.timeout_s, s.reservation_ttl_s, s.cache_ttl_s, s.cache_max_entries,
                          cluster=s.cluster, max_memory_fraction=s.max_memory_fraction)
    return MemoryStore(reservation_ttl_s=s.reservation_ttl_s, cache_ttl_s=s.cache_ttl_s,
                       cache_max_entries=s.cache_max_entries, responses_max_entries=s.responses_max_entries,
                       max_bytes=s.memory_max_bytes)
