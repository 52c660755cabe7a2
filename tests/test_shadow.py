"""Shadow answers (gateway/shadow/): sampling, the operator's budget, skips, the comparator by
answer format, pooled figures, the quality target's controller, the admin report and metrics.

Unit tests drive the service with the fakes (tests/fakes.py) over an in-process store; the
integration tests use real Redis and real gateways with a llama-server upstream.
"""

from __future__ import annotations

import logging
import random
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from adapters.memory_store import MemoryStore
from gateway.settings import RoutingOverride, RoutingSettings, Settings, SettingsError, TenantSettings, load_settings
from gateway.shadow.cases import ShadowCase, case_of, changes_routing, cut_at_stop
from gateway.settings.shadow import KnobSettings, OperatorShadowSettings, TenantShadow
from gateway.shadow.controller import KnobController
from gateway.shadow.figures import OVERRIDDEN, figures_of
from gateway.shadow.metrics import ShadowCollector
from gateway.shadow.report import quality_report
from gateway.shadow.lanes import feeders
from gateway.shadow.service import Shadow
from gateway.tenancy.budget import Ledger
from gateway.tenancy.routing import resolve_routing
from policies.online_check import wilson
from tests.conftest import gateway_config
from tests.fakes import FakeUpstream
from tests.test_observability import samples, value

SHADOWED = {"policy": "entropy", "threshold": 3.0, "shadow": {"rate": 1.0}}
STEERED = {**SHADOWED, "quality_target": 0.8,
           "knob": {"field": "threshold", "floor": 1.0, "ceiling": 4.0, "step": 0.5, "window": 5, "dead_band": 0.05}}


def tenant_settings(**changes) -> TenantSettings:
    """A tenant's settings: every alias, data may leave, no overrides, unless `changes` say otherwise."""
    return TenantSettings(**{"id": "t", "api_key_env": "T_KEY", **changes})


def make_shadow(routing: dict, upstream: FakeUpstream | None = None, store: MemoryStore | None = None,
                tenants: int = 1, seed: int = 0, **operator) -> Shadow:
    alias = SimpleNamespace(settings=SimpleNamespace(routing=RoutingSettings(**routing)), local=None,
                            upstream=upstream or FakeUpstream("The answer is 42."))
    settings = SimpleNamespace(shadow=OperatorShadowSettings(**operator),
                               tenants=[tenant_settings() for _ in range(tenants)])
    return Shadow.of(settings, {"routed": alias}, Ledger(store or MemoryStore()), rng=random.Random(seed))


def case(answer: str, tenant: str = "demo", routed_cost: float = 1e-6, max_tokens: int = 16,
         **changes) -> ShadowCase:
    return ShadowCase(alias="routed", tenant=tenant, tenant_rate=changes.pop("tenant_rate", None), answer=answer,
                      routed_cost=routed_cost, max_tokens=max_tokens, messages=[{"role": "user", "content": "q?"}],
                      **changes)


async def drain(shadow: Shadow) -> list[bool | None]:
    """Answer every queued case, as the workers would, then write and read the pooled counts."""
    outcomes = []
    while not shadow.queue.empty():
        lane, queued = shadow.queue.get_nowait()
        outcomes.append(await shadow.answer(lane, queued))
        shadow.queue.task_done()
    await shadow.sync()
    return outcomes


async def pooled(store: MemoryStore, alias: str = "routed"):
    totals, _ = await store.quality_read(alias)
    return figures_of(totals)


# -- figures --

def test_wilson_interval_matches_the_textbook_and_stays_in_bounds():
    low, high = wilson(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    assert wilson(0, 10)[0] == 0.0 and round(wilson(0, 10)[1], 4) == 0.2775
    assert round(wilson(10, 10)[0], 4) == 0.7225 and wilson(10, 10)[1] == 1.0
    assert wilson(0, 0) is None


# -- the comparator by answer format, through the figures --

@pytest.mark.parametrize(("direct", "routed", "fmt", "agrees"), [
    ("Let me think. 6 x 7 = 42. The answer is 42.", "Six sevens are 42.0", "number", True),
    ("The answer is 41.", "It is 42", "number", False),
    ("B) a river bank", "B", "letter", True),
    ("B) a river bank", "The answer is (C)", "letter", False),
    ("```python\ndef f(x):\n    return x + 1  \n```", "```python\n# add one\ndef f(x):\n\n    return x + 1\n```",
     "code", True),
    ("```python\ndef f(x):\n    return x + 1\n```", "```python\ndef f(x):\n    return x - 1\n```", "code", False),
    ("paris is the capital of france", "The capital of France is Paris!", "text", True),
    ("paris is the capital of france", "I do not know that", "text", False),
])
async def test_each_answer_format_is_compared_and_counted_by_format(direct, routed, fmt, agrees):
    store = MemoryStore()
    shadow = make_shadow(SHADOWED, FakeUpstream(direct, chars_per_token=8), store)
    shadow.offer(case(routed))
    assert await drain(shadow) == [agrees]
    figures = await pooled(store)
    assert figures.by_format == {fmt: (1, int(agrees))} and (figures.samples, figures.agreed) == (1, int(agrees))


async def test_a_configured_format_overrides_auto():
    store = MemoryStore()
    shadow = make_shadow({**SHADOWED, "shadow": {"rate": 1.0, "format": "text"}}, FakeUpstream("It is 42 apples"),
                         store)
    shadow.offer(case("42"))  # as numbers these agree; as word sets they do not
    assert await drain(shadow) == [False]
    assert (await pooled(store)).by_format == {"text": (1, 0)}


# -- sampling, costs and the ledgers --

async def test_figures_hold_costs_savings_and_the_share_sampled():
    store = MemoryStore()
    shadow = make_shadow({**SHADOWED, "shadow": {"rate": 0.5}}, store=store, seed=3, queue=64)
    for _ in range(40):
        shadow.offer(case("42", routed_cost=2e-6))
    await drain(shadow)
    figures = await pooled(store)
    assert figures.eligible == 40 and 10 <= figures.sampled <= 30 and figures.samples == figures.sampled
    assert figures.routed_cost == pytest.approx(2e-6 * figures.samples)
    per_call = FakeUpstream("The answer is 42.").estimate_cost(10, 10)  # 17 characters: 9 tokens and the end
    assert figures.upstream_cost == pytest.approx(per_call * figures.samples)
    assert figures.savings == pytest.approx(figures.upstream_cost - figures.routed_cost)
    assert figures.share_sampled == figures.samples / 40


async def test_the_shadow_call_is_billed_to_the_operator_never_the_tenant():
    store = MemoryStore()
    shadow = make_shadow(SHADOWED, store=store, operator="ops")
    shadow.offer(case("42"))
    await drain(shadow)
    now = time.time()
    tenant, operator = await store.usage("demo", now), await store.usage("ops", now)
    assert all(w.upstream_prompt_tokens + w.upstream_completion_tokens == w.upstream_cost_usd == 0 for w in tenant)
    assert all(w.upstream_completion_tokens > 0 and w.upstream_cost_usd > 0 for w in operator)


async def test_the_operator_budget_caps_shadow_spend():
    store = MemoryStore()
    # one call reserves 26 tokens' worth (10 prompt + 16 asked) and bills 20: a second does not fit
    shadow = make_shadow(SHADOWED, store=store, daily={"upstream_cost_usd": 3e-5})
    for _ in range(3):
        shadow.offer(case("42"))
    assert await drain(shadow) == [True, None, None]
    figures = await pooled(store)
    assert figures.samples == 1 and figures.skipped == {"budget": 2} and figures.sampled == 3
    (day, _) = await store.usage("shadow-operator", time.time())
    assert day.upstream_cost_usd <= 3e-5


async def test_an_open_breaker_and_a_full_queue_skip_by_reason():
    store = MemoryStore()
    upstream = FakeUpstream("42", available=False)
    shadow = make_shadow(SHADOWED, upstream, store, queue=1)
    shadow.offer(case("42"))
    upstream.available = True
    for _ in range(3):
        shadow.offer(case("42"))  # no worker runs: one waits, two find the queue full
    assert upstream.calls == [] and shadow.queue.qsize() == 1
    await drain(shadow)
    assert (await pooled(store)).skipped == {"breaker": 1, "queue": 2}


async def test_a_failed_shadow_call_gives_its_reservation_back():
    store = MemoryStore()
    shadow = make_shadow(SHADOWED, FakeUpstream("42", fail=True), store)
    shadow.offer(case("42"))
    assert await drain(shadow) == [None]
    assert (await pooled(store)).skipped == {"failed": 1}
    assert await store.headroom("shadow-operator", shadow.limits, time.time()) == (await store.headroom(
        "nobody", shadow.limits, time.time()))


async def test_a_tenant_set_off_is_not_even_eligible_and_a_tenant_rate_overrides():
    store = MemoryStore()
    shadow = make_shadow(SHADOWED, store=store)
    shadow.offer(case("42", tenant="quiet", tenant_rate=0.0))
    shadow.offer(case("42", tenant="demo"))
    await drain(shadow)
    totals, _ = await store.quality_read("routed")
    assert figures_of(totals).eligible == 1 and "t:quiet:eligible" not in totals


def test_only_like_for_like_answers_of_tenants_whose_data_may_leave_become_cases():
    assert case_of(SimpleNamespace()) is None  # passed through whole: no token-level answer
    request = SimpleNamespace(grammar=None, messages=[], prompt=None, continue_final=False, seed=None, stop=(),
                              sampling=SimpleNamespace(temperature=0.0, top_p=1.0),
                              rules=SimpleNamespace(upstream_params=dict))
    decoding = SimpleNamespace(finish_reason=None, request=request, text=SimpleNamespace(text="42"), limit=8,
                               usage=SimpleNamespace(upstream_cost_usd=0.0), gate=SimpleNamespace(cache_scope="s"),
                               rated=None)
    tenant = SimpleNamespace(id="demo", settings=SimpleNamespace(allow_upstream=True, shadow=None))
    started = SimpleNamespace(decodings=[decoding], tenant=tenant, alias=SimpleNamespace(name="routed"))
    assert case_of(started) is None  # unfinished (the client left)
    decoding.finish_reason = "stop"
    assert case_of(started).answer == "42"
    assert case_of(SimpleNamespace(**{**vars(started), "decodings": [decoding, decoding]})) is None  # n > 1
    tenant.settings.allow_upstream = False  # data never leaves the box: not even for a shadow answer
    assert case_of(started) is None
    tenant.settings.allow_upstream, request.grammar = True, "root ::= x"
    assert case_of(started) is None  # under a grammar
    assert cut_at_stop("one\ntwo END three", ("END", "\n\n")) == "one\ntwo "


# -- replicas pool their samples --

async def test_two_replicas_on_one_store_pool_their_samples_and_their_knob_window():
    store = MemoryStore()
    one, two = make_shadow(STEERED, store=store), make_shadow(STEERED, store=store)
    for _ in range(3):
        one.offer(case("no"))
    for _ in range(2):
        two.offer(case("no"))
    await drain(one)
    await drain(two)
    figures = await pooled(store)
    assert (figures.samples, figures.agreed, figures.eligible) == (5, 0, 5)
    await one.sync()  # the replica that did not fill the window follows the moved knob
    routing = RoutingSettings(**STEERED)
    assert one.routing_of("routed", routing).threshold == two.routing_of("routed", routing).threshold == 2.5


# -- the quality target's controller --

def test_the_controller_moves_toward_the_target_with_a_dead_band():
    knob = KnobSettings(field="threshold", floor=1.0, ceiling=4.0, step=0.5, window=10, dead_band=0.05)
    controller = KnobController(0.8, knob, knob.quality_sign("entropy"))
    assert controller.sign == -1  # entropy: a lower threshold routes more
    assert controller.delta(5, 10) == -0.5  # below the band: toward agreement
    assert controller.delta(8, 10) == 0.0 and controller.delta(85, 100) == 0.0  # inside the band: hold
    assert controller.delta(10, 10) == 0.5  # above: toward lower cost
    assert KnobController(0.8, knob, knob.quality_sign("top1")).delta(5, 10) == 0.5
    assert controller.initial(9.0) == 4.0 and controller.initial(None) == 1.0


async def run_windows(shadow: Shadow, agreements: list[int], window: int = 5) -> list[float]:
    """Feed windows of `window` samples with the given numbers agreeing; the knob after each."""
    values = []
    for agreed in agreements:
        for i in range(window):
            shadow.offer(case("42" if i < agreed else "7"))
        await drain(shadow)
        values.append(shadow.routing_of("routed", RoutingSettings(**STEERED)).threshold)
    return values


async def test_the_knob_moves_toward_the_target_and_stops_at_its_bounds(caplog):
    shadow = make_shadow(STEERED)
    with caplog.at_level(logging.INFO, logger="gateway.shadow"):
        down = await run_windows(shadow, [0, 1, 0, 2, 0, 0])  # far below 0.8: route more, to the floor
    assert down == [2.5, 2.0, 1.5, 1.0, 1.0, 1.0]
    assert shadow.counts["moves", "routed", "down"] == 4
    moved = [r for r in caplog.records if "moved" in r.getMessage()]
    assert len(moved) == 4 and moved[0].before == 3.0 and moved[0].after == 2.5 and moved[0].knob == "threshold"
    assert any("held at its bound" in r.getMessage() for r in caplog.records)
    assert await run_windows(shadow, [4, 4]) == [1.0, 1.0]  # 0.8: inside the dead band
    up = await run_windows(shadow, [5] * 8)  # all agree: save, up to the ceiling
    assert up == [1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.0, 4.0]
    assert shadow.counts["moves", "routed", "up"] == 6


async def test_the_knob_steers_the_alias_default_and_overrides_still_win():
    shadow = make_shadow(STEERED)
    await run_windows(shadow, [0])
    alias = RoutingSettings(**STEERED)
    assert resolve_routing(shadow.routing_of("routed", alias)).threshold == 2.5
    assert resolve_routing(shadow.routing_of("routed", alias), RoutingOverride(threshold=3.3)).threshold == 3.3
    assert resolve_routing(shadow.routing_of("routed", alias), None, RoutingOverride(policy="never")).policy == "never"


# -- one tenant's reach: the shared knob, the operator's budget, /v1/models --

def finished(answer: str, tenant: str = "demo", routing: RoutingOverride | None = None,
             tenant_routing: RoutingOverride | None = None) -> SimpleNamespace:
    """A finished token-level request as case_of reads it: one choice, no grammar."""
    request = SimpleNamespace(grammar=None, messages=[{"role": "user", "content": "q?"}], prompt=None,
                              continue_final=False, seed=None, stop=(), rules=SimpleNamespace(upstream_params=dict),
                              sampling=SimpleNamespace(temperature=0.0, top_p=1.0))
    decoding = SimpleNamespace(finish_reason="stop", request=request, text=SimpleNamespace(text=answer), limit=16,
                               usage=SimpleNamespace(upstream_cost_usd=0.0), gate=SimpleNamespace(cache_scope="s"),
                               rated=None)
    settings = tenant_settings(routing=tenant_routing)
    return SimpleNamespace(decodings=[decoding], tenant=SimpleNamespace(id=tenant, settings=settings),
                           alias=SimpleNamespace(name="routed"), body=SimpleNamespace(routing=routing))


def test_an_override_changes_the_alias_routing_where_it_sets_another_value_or_the_knob():
    routing = RoutingSettings(**STEERED)
    assert not changes_routing(routing, [{"policy": "entropy"}, {"span": 1}])  # the alias's own values
    assert changes_routing(routing, [{"policy": "never"}])
    assert changes_routing(routing, [{}, {"max_upstream_tokens": 5}])
    assert changes_routing(routing, [{"threshold": 3.0}])  # the knob's field: pinned, even at the same value
    assert not changes_routing(RoutingSettings(**SHADOWED), [{"threshold": 3.0}])  # no knob: the same routing
    assert case_of(finished("42", routing=RoutingOverride(policy="never"))).overrides == ({"policy": "never"},)
    assert case_of(finished("42", tenant_routing=RoutingOverride(span=2))).overrides == ({"span": 2},)


async def test_overridden_requests_are_counted_apart_and_never_move_the_knob():
    store = MemoryStore()
    shadow = make_shadow(STEERED, store=store, queue=64)
    for _ in range(22):  # all disagree: fed to the knob, 4 windows would take it from 3.0 to the floor
        shadow.offer(case_of(finished("7", routing=RoutingOverride(policy="never"))))
    shadow.offer(case_of(finished("7", tenant_routing=RoutingOverride(threshold=1.0))))  # a tenant's own, too
    assert await drain(shadow) == [False] * 23
    assert shadow.routing_of("routed", RoutingSettings(**STEERED)).threshold == 3.0
    totals, _ = await store.quality_read("routed")
    assert figures_of(totals).samples == figures_of(totals).eligible == 0
    apart = figures_of(totals, OVERRIDDEN)
    assert (apart.eligible, apart.samples, apart.agreed) == (23, 23, 0)
    (entry,) = (await quality_report(shadow, time.time(), minutes=10))["aliases"]
    assert entry["figures"]["samples"] == 0 and entry["timeline"][-1]["samples"] == 0
    assert entry["overridden"]["figures"]["samples"] == 23 and entry["overridden"]["tenants"]["demo"]["samples"] == 23
    shadow.offer(case_of(finished("7", routing=RoutingOverride(policy="entropy"))))  # the alias's own: it counts
    await drain(shadow)
    assert (await pooled(store)).samples == 1


async def test_one_tenant_alone_cannot_move_a_knob_that_tenants_share():
    store = MemoryStore()
    shadow = make_shadow(STEERED, store=store, tenants=2, queue=64)
    routing = RoutingSettings(**STEERED)
    for _ in range(25):  # five windows' worth, all disagreeing
        shadow.offer(case("7", tenant="loud"))
    await drain(shadow)
    assert shadow.routing_of("routed", routing).threshold == 3.0  # at most 3 of each window of 5 are one tenant's
    assert (await pooled(store)).samples == 25  # its samples still count in the figures
    for _ in range(2):
        shadow.offer(case("7", tenant="quiet"))
    await drain(shadow)
    assert shadow.routing_of("routed", routing).threshold == 2.5  # two tenants filled the window: it moved
    for tenant in ["loud"] * 4 + ["quiet"] * 2:  # a new window: each tenant's share starts again
        shadow.offer(case("7", tenant=tenant))
    await drain(shadow)
    assert shadow.routing_of("routed", routing).threshold == 2.0


def test_only_tenants_that_can_feed_a_knob_share_it():
    routing = RoutingSettings(**STEERED)
    tenants = [tenant_settings(), tenant_settings(shadow=TenantShadow(rate=0.0)), tenant_settings(aliases=["other"]),
               tenant_settings(allow_upstream=False), tenant_settings(routing=RoutingOverride(policy="never"))]
    assert feeders(tenants, "routed", routing) == 1
    assert make_shadow(STEERED).lanes["routed"].tenant_cap is None  # one tenant's knob is its own
    assert make_shadow(STEERED, tenants=2).lanes["routed"].tenant_cap == 3


async def test_a_tenant_created_after_start_shares_the_knob_and_the_budget_from_the_next_refresh():
    directory = [tenant_settings()]
    alias = SimpleNamespace(settings=SimpleNamespace(routing=RoutingSettings(**STEERED)), local=None,
                            upstream=FakeUpstream("The answer is 42."))
    settings = SimpleNamespace(shadow=OperatorShadowSettings(daily={"upstream_cost_usd": 1.0}), tenants=directory[:])
    shadow = Shadow.of(settings, {"routed": alias}, Ledger(MemoryStore()), tenants=lambda: directory)
    assert shadow.lanes["routed"].tenant_cap is None and shadow.tenant_limits is None
    directory.append(tenant_settings(id="api-made"))  # through POST /admin/tenants: not in config.yaml
    await shadow.sync()
    assert shadow.lanes["routed"].tenant_cap == 3 and shadow.tenant_limits.day_cost_usd == 0.25


async def test_a_shadow_call_asks_for_at_most_shadow_max_tokens():
    store = MemoryStore()
    long_answer = "word " * 300  # 750 tokens at 2 characters a token
    shadow = make_shadow(SHADOWED, FakeUpstream(long_answer), store, operator="ops")
    shadow.offer(case("word", max_tokens=1024))  # the client asked for 1,024
    assert await drain(shadow) == [None]  # cut at 256 where the routed answer could run on: not compared
    (day, _) = await store.usage("ops", time.time())
    assert day.upstream_completion_tokens == OperatorShadowSettings().max_tokens == 256
    assert (await pooled(store)).skipped == {"length": 1}
    short = make_shadow(SHADOWED, store=MemoryStore(), max_tokens=8)
    short.offer(case("42", max_tokens=1024))
    short.offer(case("42", max_tokens=4))  # under the cap: the routed answer's own limit, as before
    await drain(short)
    (day, _) = await short.ledger.store.usage("shadow-operator", time.time())
    assert day.upstream_completion_tokens == 8 + 4


async def test_a_tenant_spends_at_most_its_share_of_the_shadow_budget():
    store = MemoryStore()
    # one call reserves 26 tokens' worth (10 prompt + 16 asked) and bills 20: a quarter of 1.2e-4 fits one
    shadow = make_shadow(SHADOWED, store=store, tenants=2, queue=64, daily={"upstream_cost_usd": 1.2e-4})
    for tenant in ("greedy", "greedy", "greedy", "other", "other"):
        shadow.offer(case("42", tenant=tenant))
    assert await drain(shadow) == [True, None, None, True, None]
    figures = await pooled(store)
    assert figures.samples == 2 and figures.skipped == {"tenant_share": 3}
    now = time.time()
    (greedy, _), (other, _) = [await store.usage(f"shadow-operator:{tenant}", now) for tenant in ("greedy", "other")]
    assert 0 < greedy.upstream_cost_usd <= 3e-5 and 0 < other.upstream_cost_usd <= 3e-5
    (operator, _) = await store.usage("shadow-operator", now)
    assert operator.upstream_cost_usd == pytest.approx(greedy.upstream_cost_usd + other.upstream_cost_usd)
    assert make_shadow(SHADOWED, daily={"upstream_cost_usd": 1.2e-4}).tenant_limits is None  # one tenant: all of it


def test_models_show_a_tenant_only_the_routing_it_can_set():
    from fastapi.testclient import TestClient

    from gateway.api.app import create_app

    settings = settings_with(STEERED)

    async def start(_settings):
        async def close():
            pass
        alias = SimpleNamespace(settings=settings.aliases["routed"], upstream=None)
        tenant = SimpleNamespace(id="demo", may_use=lambda name: True)
        return SimpleNamespace(aliases={"routed": alias}, local_models={}, shadow=None, closed=False, close=close,
                               tenants=SimpleNamespace(authenticate=lambda key: tenant if key == "sk-t" else None,
                                                       is_admin=lambda key: False))

    with TestClient(create_app(settings, start_runtime=start)) as client:
        answer = client.get("/v1/models", headers={"Authorization": "Bearer sk-t"})
    assert answer.status_code == 200
    (model,) = answer.json()["data"]
    assert model["routing"]["policy"] == "entropy" and model["routing"]["threshold"] == 3.0
    assert not {"shadow", "quality_target", "knob", "router"} & set(model["routing"])
    assert not any(name in answer.text for name in ('"shadow"', '"quality_target"', '"floor"', '"ceiling"'))


# -- settings --

def settings_with(routing: dict | None = None, **top) -> Settings:
    config = gateway_config("http://127.0.0.1:9/v1", **top)
    if routing is not None:
        config["aliases"]["routed"]["routing"] = routing
    return Settings.model_validate(config)


@pytest.mark.parametrize(("routing", "top", "needle"), [
    ({**SHADOWED, "quality_target": 0.8}, {}, "quality_target and knob go together"),
    ({**STEERED, "shadow": None}, {}, "needs shadow answers"),
    ({**SHADOWED, "shadow": {"rate": 0}}, {}, "greater than 0"),
    ({**STEERED, "quality_target": 1.0}, {}, "less than 1"),
    ({**STEERED, "knob": {**STEERED["knob"], "floor": 5.0}}, {}, "must be below its ceiling"),
    ({**STEERED, "knob": {**STEERED["knob"], "field": "target_fraction"}}, {}, "within [0.0, 1.0]"),
    ({**STEERED, "policy": "always", "threshold": None}, {}, "policy 'always' does not read threshold"),
    ({**STEERED, "knob": {**STEERED["knob"], "field": "target_fraction", "floor": 0.1, "ceiling": 0.9}}, {},
     "policy 'entropy' does not read target_fraction"),
    ({**STEERED, "knob": {**STEERED["knob"], "field": "escalate_below", "floor": 0.1, "ceiling": 0.9}}, {},
     "does not read escalate_below without an answer_check"),
    ({**STEERED, "policy": "top1", "threshold": 0.5, "knob": {**STEERED["knob"], "more_quality": None}}, {},
     None),
    (None, {"shadow": {"operator": "demo"}}, "shadow.operator: 'demo' is a client tenant"),
])
def test_bad_shadow_settings_are_refused_naming_the_key(tmp_path, routing, top, needle):
    import yaml

    config = gateway_config("http://127.0.0.1:9/v1", **top)
    if routing is not None:
        config["aliases"]["routed"]["routing"] = routing
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    if needle is None:  # top1: a higher threshold routes more, which the controller knows
        assert load_settings(path).aliases["routed"].routing.knob.quality_sign("top1") == 1
        return
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_a_tenant_says_off_in_yaml_and_an_alias_without_upstream_cannot_shadow(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("models: {local: {smol: {gguf: x.gguf}}}\n"
                    "aliases: {local: {local: smol, routing: {policy: never, shadow: {rate: 0.1}}}}\n")
    with pytest.raises(SettingsError, match="aliases.local.routing.shadow: the alias has no upstream"):
        load_settings(path)
    config = gateway_config("http://127.0.0.1:9/v1")
    config["tenants"][0]["shadow"] = False  # what YAML makes of a bare `off`
    config["tenants"].append({"id": "sampled", "api_key_sha256": "0" * 64, "shadow": "off"})
    tenants = Settings.model_validate(config).tenants
    assert tenants[0].shadow.rate == 0.0 and tenants[1].shadow.rate == 0.0
    assert settings_with(STEERED).aliases["routed"].routing.knob.window == 5


# -- the admin report and the metrics --

async def test_the_report_holds_figures_per_alias_and_tenant_a_knob_and_a_timeline():
    shadow = make_shadow(STEERED)
    shadow.offer(case("42", tenant="demo"))
    shadow.offer(case("7", tenant="other"))
    await drain(shadow)
    report = await quality_report(shadow, time.time(), minutes=10)
    assert report["object"] == "quality" and report["currency"] == "USD" and report["bucket_s"] == 60
    (entry,) = report["aliases"]
    assert entry["alias"] == "routed" and entry["rate"] == 1.0 and entry["quality_target"] == 0.8
    assert entry["knob"]["value"] == 3.0 and entry["knob"]["floor"] == 1.0
    figures = entry["figures"]
    assert figures["samples"] == 2 and figures["agreed"] == 1 and figures["agreement"] == 0.5
    assert figures["interval"][0] < 0.5 < figures["interval"][1] and figures["currency"] == "USD"
    assert set(entry["tenants"]) == {"demo", "other"} and entry["tenants"]["demo"]["agreement"] == 1.0
    assert len(entry["timeline"]) == 10 and entry["timeline"][-1]["samples"] == 2
    operator = report["operator"]
    assert operator["tenant"] == "shadow-operator" and operator["windows"][0]["upstream_cost_usd"] > 0
    assert report["process"]["store_writes"] >= 2


@pytest.mark.parametrize(("tenants", "labelled"), [(2, True), (20, False)])
async def test_metrics_carry_alias_always_and_tenant_only_while_tenants_are_few(tenants, labelled):
    shadow = make_shadow(STEERED, tenants=tenants)
    shadow.offer(case("42"))
    shadow.offer(case("7"))
    await drain(shadow)
    registry = CollectorRegistry()
    registry.register(ShadowCollector(lambda: shadow))
    m = samples(generate_latest(registry).decode())
    assert value(m, "gateway_shadow_samples_total", alias="routed", outcome="agree") == 1
    assert value(m, "gateway_shadow_eligible_total", alias="routed") == 2
    assert value(m, "gateway_shadow_cost_usd_total", alias="routed", answer="routed") == pytest.approx(2e-6)
    assert value(m, "gateway_shadow_agreement", alias="routed", bound="estimate") == 0.5
    assert value(m, "gateway_shadow_knob", alias="routed", field="threshold") == 3.0
    tenant_series = value(m, "gateway_shadow_tenant_samples_total", alias="routed", tenant="demo", outcome="agree")
    assert tenant_series == (1 if labelled else 0)
    assert all("tenant" not in dict(labels) for _, labels in m) or labelled


# -- integration: real Redis, real gateways --

@pytest.fixture
def redis_prefix(redis_url):
    """A key prefix of this test's own on the real Redis; its keys are deleted after."""
    import uuid

    import redis

    prefix = f"shadow-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


@pytest.fixture
def redis_store(redis_url, redis_prefix):
    """Two replicas' clients of one real Redis, under the test's own prefix."""
    from adapters.redis_store import RedisStore

    return [RedisStore(redis_url, redis_prefix, 2.0, 60.0, 60.0) for _ in range(2)]


@pytest.mark.integration
async def test_redis_keeps_counts_buckets_and_knobs_as_the_memory_store_does(redis_store):
    one, two = redis_store
    await one.quality_add("routed", {"samples": 1, "routed_cost": 1.5e-6}, 7, {"samples": 1, "agreed": 1}, 60)
    await two.quality_add("routed", {"samples": 2, "routed_cost": 0.5e-6}, 8, {"samples": 2}, 60)
    totals, buckets = await one.quality_read("routed", [6, 7, 8])
    assert totals == {"samples": 3.0, "routed_cost": pytest.approx(2e-6)}
    assert buckets == [{}, {"samples": 1.0, "agreed": 1.0}, {"samples": 2.0}]
    assert [await store.knob_window("k", True, 3) for store in (one, two, one)] == [None, None, (3, 3)]
    assert await two.knob_window("k", False, 3) is None  # the full window was emptied
    assert await one.knob_read("k") is None
    assert await one.knob_move("k", 3.0, -0.25, 1.0, 4.0) == (3.0, 2.75)
    assert await two.knob_move("k", 3.0, -2.0, 1.0, 4.0) == (2.75, 1.0)  # never past the floor
    assert await two.knob_read("k") == 1.0


@pytest.mark.integration
async def test_two_replicas_on_one_redis_pool_samples_and_steer_alike(redis_store):
    one = make_shadow(STEERED)
    two = make_shadow(STEERED)
    one.ledger, two.ledger = Ledger(redis_store[0]), Ledger(redis_store[1])
    for shadow, answers in ((one, ["7", "7", "42"]), (two, ["7", "7"])):
        for answer in answers:
            shadow.offer(case(answer))
        await drain(shadow)
    await one.sync()
    totals, _ = await redis_store[1].quality_read("routed")
    assert (figures_of(totals).samples, figures_of(totals).agreed) == (5, 1)
    routing = RoutingSettings(**STEERED)
    assert one.routing_of("routed", routing).threshold == two.routing_of("routed", routing).threshold == 2.5


class HoldingProxy:
    """An HTTP proxy in front of an upstream server that can hold the calls it forwards, so a test
    knows a call cannot have ended while it holds."""

    def __init__(self, target: str) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.target, self.calls, self.released = target.removesuffix("/v1"), 0, threading.Event()
        self.released.set()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                proxy.forward(self, "POST")

            def do_GET(self) -> None:
                proxy.forward(self, "GET")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def forward(self, handler, method: str) -> None:
        import httpx

        body = handler.rfile.read(int(handler.headers.get("content-length") or 0))
        if method == "POST":
            with self._lock:
                self.calls += 1
            self.released.wait(120)
        answer = httpx.request(method, self.target + handler.path, content=body, timeout=120,
                               headers={"content-type": handler.headers.get("content-type", "application/json")})
        handler.send_response(answer.status_code)
        handler.send_header("content-type", answer.headers.get("content-type", "application/json"))
        handler.send_header("content-length", str(len(answer.content)))
        handler.end_headers()
        handler.wfile.write(answer.content)

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()


def shadow_config(upstream: str, **store) -> dict:
    config = gateway_config(upstream, mode="tokens")
    # local only, as the requests ask: a request whose routing differs from the alias's is counted apart
    config["aliases"]["routed"]["routing"] = {"policy": "never", "shadow": {"rate": 1.0}}
    config["shadow"] = {"operator": "ops", "refresh_s": 0.5}
    if store:
        config["store"] = store
    return config


def admin_quality(gateway) -> dict:
    import httpx

    from tests.conftest import ADMIN_KEY

    answer = httpx.get(f"{gateway.base_url}/admin/quality", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                       timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def wait_for_samples(gateway, count: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        report = admin_quality(gateway)
        if report["aliases"][0]["figures"]["samples"] >= count or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


QUESTION = [{"role": "user", "content": "What is 6 times 7? Answer with a number."}]


@pytest.mark.integration
def test_a_live_gateway_answers_first_and_bills_the_shadow_to_the_operator(smol_llama_server, tmp_path):
    import httpx

    from tests.conftest import ADMIN_KEY, DEMO_KEY, live_gateway

    proxy = HoldingProxy(smol_llama_server)
    try:
        with live_gateway(shadow_config(proxy.base), tmp_path) as gateway:
            client = gateway.client()
            local_only = {"routing": {"policy": "never"}}  # the routed answer makes no upstream call of its own
            proxy.released.clear()
            answer = client.chat.completions.create(model="routed", messages=QUESTION, max_tokens=24, temperature=0,
                                                    extra_body=local_only)
            # the client has its whole answer while the shadow call is held: the answer did not wait for it
            assert answer.choices[0].message.content and admin_quality(gateway)["aliases"][0]["figures"]["samples"] == 0
            chunks = list(client.chat.completions.create(model="routed", messages=QUESTION, max_tokens=24,
                                                         temperature=0, stream=True, extra_body=local_only))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            assert admin_quality(gateway)["aliases"][0]["figures"]["samples"] == 0
            proxy.released.set()
            report = wait_for_samples(gateway, 2)
            figures = report["aliases"][0]["figures"]
            assert figures["samples"] == 2 and figures["eligible"] == 2 and figures["upstream_only_cost"] > 0
            assert figures["routed_cost"] == 0 and figures["savings"] == figures["upstream_only_cost"]
            assert proxy.calls == 2
            usage = httpx.get(f"{gateway.base_url}/v1/usage", headers={"Authorization": f"Bearer {DEMO_KEY}"}).json()
            assert all(w["upstream_prompt_tokens"] == w["upstream_cost_usd"] == 0 for w in usage["windows"])
            assert all(w["upstream_cost_usd"] > 0 for w in report["operator"]["windows"])
            assert set(report["aliases"][0]["tenants"]) == {"demo"}
            denied = httpx.get(f"{gateway.base_url}/admin/quality", headers={"Authorization": f"Bearer {DEMO_KEY}"})
            assert denied.status_code == 403
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            bad = httpx.get(f"{gateway.base_url}/admin/quality?minutes=0", headers=admin)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "minutes"
            metrics = httpx.get(f"{gateway.base_url}/metrics", headers=admin).text
            assert value(samples(metrics), "gateway_shadow_eligible_total", alias="routed") == 2
    finally:
        proxy.close()


@pytest.mark.integration
def test_two_live_gateways_on_one_redis_pool_their_samples(smol_llama_server, redis_url, tmp_path):
    import uuid

    from tests.conftest import live_gateway

    store = {"backend": "redis", "url": redis_url, "key_prefix": f"shadow-live-{uuid.uuid4().hex[:8]}"}
    first = shadow_config(smol_llama_server, **store)
    second = {**shadow_config(smol_llama_server, **store), "server": {**first["server"], "port": None}}
    from tests.conftest import free_port

    second["server"]["port"] = free_port()
    try:
        with live_gateway(first, tmp_path) as one, live_gateway(second, tmp_path) as two:
            for gateway, count in ((one, 2), (two, 1)):
                for _ in range(count):
                    gateway.client().chat.completions.create(model="routed", messages=QUESTION, max_tokens=16,
                                                             temperature=0, extra_body={"routing": {"policy": "never"}})
            figures = wait_for_samples(one, 3)["aliases"][0]["figures"]
            assert figures["samples"] == 3 and figures["eligible"] == 3
            assert admin_quality(two)["aliases"][0]["figures"]["samples"] == 3
    finally:
        import redis

        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{store['key_prefix']}:*"):
            client.delete(key)


@pytest.mark.integration
def test_the_playground_plots_agreement_per_time_bucket(smol_llama_server, tmp_path):
    import json

    from tests.conftest import ADMIN_KEY, ROOT, live_gateway
    from tests.test_playground import Browser, chromium_binary

    with live_gateway(shadow_config(smol_llama_server), tmp_path) as gateway:
        for _ in range(2):
            gateway.client().chat.completions.create(model="routed", messages=QUESTION, max_tokens=16, temperature=0,
                                                     extra_body={"routing": {"policy": "never"}})
        assert wait_for_samples(gateway, 2)["aliases"][0]["figures"]["samples"] == 2
        browser = Browser(chromium_binary())
        try:
            browser.open(f"{gateway.base_url}/playground")
            browser.js(f"$('api-key').value = {json.dumps(ADMIN_KEY)}; $('quality').click();")
            browser.wait_for("!!window.playground.quality")
            title = browser.js("document.querySelector('.quality-alias h3').textContent")
            assert title.startswith("routed: agreement") and title.endswith("over 2 samples")
            assert browser.js("document.querySelector('.quality-alias canvas').dataset.points") in ("1", "2")
            browser.screenshot(ROOT / "artifacts" / "playground-quality.png")
        finally:
            browser.close()
