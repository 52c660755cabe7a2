"""The shadow service: draws a share of finished answers, asks the upstream each one directly in
the background, compares the two answers by format, and pools the counts in the Store.

`offer(case)` is called once the client has its whole answer (a response's background task, or a
stream's end) and never waits: it draws by the rate, and queues the case if the upstream's breaker
is closed and the bounded queue has room (else a skip, counted by reason). Workers take cases from
the queue: each shadow call is reserved and settled on the operator's ledger (a HandoffGate of its
own, never the client tenant's) and, within `shadow.tenant_share` of the operator's budget, on a
ledger of the tenant's shadow spending (`share_ledger`), asked with the same prompt and sampling
as the routed answer and its max_tokens up to `shadow.max_tokens`, and compared; its text is then
dropped: only counts reach the Store.

An alias with a quality target feeds each sample into its knob's pooled window; a full window may
move the knob (gateway/shadow/controller.py), and `routing_of` hands the moved value to admission.
The knob learns only from traffic it governs: a request whose tenant's or own `routing` changed
the alias's (cases.changes_routing) is counted apart (figures.OVERRIDDEN) and never fed to it; and
where two or more tenants can feed it (counted at each refresh, tenants created through the admin
API included: `count_tenants`), one tenant fills at most half of each window (`_within_share`), so
no tenant moves it alone.

An alias with `routing.learn` turns the samples of its own routing into labelled examples instead
(gateway/shadow/learning.py): `routing_of` hands admission the routing its learned check (or cold
start) runs, and a background task per learning alias fits and promotes checks. Lanes
(gateway/shadow/lanes.py) carry on through a reload that leaves their alias alone (`of`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import replace
from typing import Any

from adapters.store import Limits, StoreUnavailable
from adapters.upstream import Continuation, UpstreamUnavailable
from gateway.settings import OperatorShadowSettings, RoutingSettings, TenantSettings
from gateway.shadow.cases import ShadowCase, cut_at_stop
from gateway.shadow.figures import OVERRIDDEN, check_version_prefix, sample_counts, tenant_prefix
from gateway.shadow.lanes import Lane, feeders, lane_of
from gateway.shadow.learning import keep_learning
from gateway.shadow.spending import Spend, share_ledger, tenant_share_limits
from gateway.tenancy.budget import RESERVATION_MARGIN_S, HandoffGate, Ledger
from gateway.traced import later_span
from policies.agreement import answer_format, same_answer

log = logging.getLogger("gateway.shadow")
Tenants = Callable[[], Iterable[TenantSettings]]  # the tenants now (config.yaml's and the admin API's)


class Shadow:
    """Shadow answers for every alias with `routing.shadow` (see the module docstring)."""

    def __init__(self, settings: OperatorShadowSettings, lanes: Mapping[str, Lane], ledger: Ledger,
                 tenants: Tenants = tuple, rng: random.Random | None = None, running: "Shadow | None" = None) -> None:
        self.settings, self.lanes, self.ledger, self.tenants = settings, dict(lanes), ledger, tenants
        self.limits = Limits(settings.daily.upstream_tokens, settings.daily.upstream_cost_usd,
                             settings.monthly.upstream_tokens, settings.monthly.upstream_cost_usd)
        self.tenant_limits: Limits | None = None  # one tenant's bound (`count_tenants`)
        self.tenant_labels = False  # tenant ids become metric labels (`count_tenants`)
        self.queue: asyncio.Queue[tuple[Lane, ShadowCase]] = asyncio.Queue(settings.queue)
        self.rng = rng or random.Random()
        self.counts: Counter[tuple[str, ...]] = Counter()  # this process's events, for /metrics
        self.pooled: dict[str, dict[str, float]] = {}  # each alias's pooled counters, as last read
        self._pending: dict[str, Counter[str]] = {name: Counter() for name in self.lanes}  # not yet in the store
        self.store_calls: Counter[str] = Counter()  # "write", "read": what shadowing costs the store
        self.in_flight = 0
        self._running = running  # the service this one replaces, until `tasks` takes over from it
        self.count_tenants()

    @classmethod
    def of(cls, settings: Any, aliases: MutableMapping[str, Any], ledger: Ledger, rng: random.Random | None = None,
           *, running: "Shadow | None" = None, tenants: Tenants | None = None) -> "Shadow | None":
        """The service for `settings` (the whole tree) over the runtime's `aliases`, or None when no
        alias shadows. A learning alias's entry in `aliases` is replaced by one whose answer check
        is its learner's live check, which the decoder then rates its answers with. May hash a local
        model file (a new learner's): call off the event loop.

        `running`: the service this one replaces on a reload. An alias whose local model and
        routing did not change carries its lane on (gateway/shadow/lanes.py: its learner, live
        check and knob value), and `tasks` takes over the running service's pending counts, process
        counters and queued cases (see `_take_over`). `tenants`: the tenants to count, read at each
        refresh (`count_tenants`); None: config.yaml's (`settings.tenants`)."""
        before = running.lanes if running is not None else {}
        lanes = {}
        for name, alias in list(aliases.items()):
            lane = lane_of(name, alias, settings, before.get(name))
            if lane is None:
                continue
            lanes[name] = lane
            if lane.learner is not None:
                aliases[name] = replace(alias, answer_check=lane.learner.live)
        if not lanes:
            return None
        return cls(settings.shadow, lanes, ledger, tenants or (lambda: settings.tenants), rng, running)

    def count_tenants(self) -> None:
        """Count the tenants now (`self.tenants()`: config.yaml's and those created through the
        admin API) and set what depends on them: one tenant's bound on the shadow budget and on each
        lane (`Lane.count_feeders`), and whether tenant ids label the metrics. Runs at each sync,
        so a new tenant counts within `shadow.refresh_s`."""
        tenants = list(self.tenants())
        self.tenant_limits = tenant_share_limits(self.limits, self.settings.tenant_share) if len(tenants) > 1 else None
        self.tenant_labels = 0 < len(tenants) <= self.settings.tenant_labels
        for lane in self.lanes.values():
            lane.count_feeders(feeders(tenants, lane.name, lane.routing))

    def routing_of(self, alias: str, routing: RoutingSettings) -> RoutingSettings:
        """`routing` (the alias's own) with its knob's current value, if a controller moves one."""
        lane = self.lanes.get(alias)
        if lane is not None and lane.learner is not None:
            return lane.learner.routing_of(routing)
        return routing if lane is None or lane.steered is None else lane.steered

    def offer(self, case: ShadowCase | None) -> None:
        """Draw `case` by its rate and queue it; never waits (see the module docstring)."""
        lane = self.lanes.get(case.alias) if case is not None else None
        if lane is None:
            return
        rate = lane.rate if case.tenant_rate is None else case.tenant_rate
        if rate <= 0:
            return  # the tenant is off: not even eligible
        self._note(lane, case, "eligible")
        if self.rng.random() >= rate:
            return
        self._note(lane, case, "sampled")
        if not lane.upstream.available:
            self._skip(lane, "breaker", case)
            return
        try:
            self.queue.put_nowait((lane, case))
        except asyncio.QueueFull:
            self._skip(lane, "queue", case)

    def tasks(self) -> list[Any]:
        """The coroutines to run for the service's life: the workers, the refresher and one learning
        loop per learning alias. Called once, on the event loop, when the service starts serving:
        first it takes over what the service it replaces still holds (`_take_over`)."""
        self._take_over()
        learning = [keep_learning(lane.learner, self.ledger.store, self.store_calls)
                    for lane in self.lanes.values() if lane.learner is not None]
        return [self.work() for _ in range(self.settings.workers)] + [self.refresh()] + learning

    def _take_over(self) -> None:
        """Take from the service this one replaces (its tasks stopped, or about to): its process
        counters and pending counts of the aliases still shadowed, and the queued cases of carried
        lanes. Cases of an alias that no longer shadows, or whose routing or model changed (they ran
        other routing than the lane's now), are dropped."""
        running, self._running = self._running, None
        if running is None:
            return
        self.counts.update({key: n for key, n in running.counts.items() if key[1] in self.lanes})
        self.store_calls.update(running.store_calls)
        for name, pending in running._pending.items():
            if name in self._pending:
                self._pending[name].update(pending)
        while not running.queue.empty():
            lane, case = running.queue.get_nowait()
            running.queue.task_done()
            carried = self.lanes.get(lane.name)
            if carried is not None and carried.carried:
                try:
                    self.queue.put_nowait((carried, case))
                except asyncio.QueueFull:
                    self._skip(carried, "queue", case)

    async def work(self) -> None:
        """Run until cancelled: answer queued cases one at a time."""
        while True:
            lane, case = await self.queue.get()
            self.in_flight += 1
            try:
                with later_span("gateway.shadow_call", case.trace, {"gateway.alias": lane.name}):
                    await self.answer(lane, case)
            except Exception:  # noqa: BLE001 - one bad case must not stop the worker
                log.exception("shadow answer of alias %s failed", lane.name)
            finally:
                self.in_flight -= 1
                self.queue.task_done()

    async def refresh(self) -> None:
        """Run until cancelled: sync at once (a new or reloaded service reads the promoted checks
        and knob values before its first interval), then every `refresh_s`, so that every replica
        steers by the same value."""
        while True:
            await self.sync()
            await asyncio.sleep(self.settings.refresh_s)

    async def sync(self) -> None:
        """Count the tenants, then per alias write pending counts and read its pooled counters,
        promoted check and knob. Never raises: a store fault waits for the next sync, any other
        fault is logged and skips that alias (or the count) this time."""
        try:
            self.count_tenants()
        except Exception:  # noqa: BLE001 - the last count stands; the refresher must go on
            log.exception("counting the tenants that feed shadow answers failed")
        for lane in self.lanes.values():
            try:
                await self._sync_lane(lane)
            except StoreUnavailable:
                continue
            except Exception:  # noqa: BLE001 - one bad record must not stop the refresher
                log.exception("shadow sync of alias %s failed", lane.name)

    async def _sync_lane(self, lane: Lane) -> None:
        if self._pending[lane.name]:
            await self._write(lane, {})
        self.store_calls["read"] += 1
        self.pooled[lane.name], _ = await self.ledger.store.quality_read(lane.name)
        if lane.learner is not None:
            self.store_calls["read"] += 1
            await lane.learner.sync(self.ledger.store)
        if lane.controller is not None:
            self.store_calls["read"] += 1
            value = await self.ledger.store.knob_read(lane.knob)
            if value is not None:
                lane.steer(value)

    async def answer(self, lane: Lane, case: ShadowCase) -> bool | None:
        """Ask, compare and count one case; None when it was skipped (counted by reason)."""
        upstream = lane.upstream
        if not upstream.available:
            return self._skip(lane, "breaker", case)
        handoff = upstream.text_handoff(case.prompt, case.scope) if case.prompt is not None else \
            upstream.handoff(case.messages, case.continue_final, case.scope)
        if handoff is None:  # raw text, and an upstream that continues chats only
            return self._skip(lane, "unsupported", case)
        handoff = upstream.with_answer(handoff, "")
        max_tokens = min(case.max_tokens, self.settings.max_tokens)
        prompt = upstream.estimate_prompt_tokens(handoff)
        spend = await self._reserve(case.tenant, prompt + max_tokens, upstream.estimate_cost(prompt, max_tokens),
                                    upstream.worst_case_s + RESERVATION_MARGIN_S)
        if isinstance(spend, str):
            return self._skip(lane, spend, case)
        got = await self._call(lane, case, handoff, max_tokens, spend)
        if got is None:
            return self._skip(lane, "failed", case)
        direct = cut_at_stop(got.text, case.stop)
        if max_tokens < case.max_tokens and not got.finished and direct == got.text:
            return self._skip(lane, "length", case)  # cut by shadow.max_tokens, not the routed answer's own limit
        return await self._compare(lane, case, direct, got.cost_usd)

    async def _call(self, lane: Lane, case: ShadowCase, handoff: Any, max_tokens: int,
                    spend: Spend) -> Continuation | None:
        """The upstream's direct answer to `handoff`, settled on `spend`; None when the upstream
        failed (`spend` released)."""
        greedy = lane.routing.shadow.sampling == "greedy"
        call = asyncio.ensure_future(lane.upstream.continue_text(
            handoff, max_tokens, 0.0 if greedy else case.temperature, 1.0 if greedy else case.top_p,
            None if greedy else case.seed, case.extra))
        try:
            got: Continuation = await asyncio.shield(call)
        except UpstreamUnavailable as exc:
            await spend.release()
            log.info("shadow call of alias %s failed: %s", lane.name, exc)
            return None
        except BaseException:  # shut down mid-call: the upstream bills it all the same
            spend.finish_in_background(call)
            raise
        await spend.settle(got)
        return got

    async def _reserve(self, tenant: str, tokens: int, cost_usd: float, ttl_s: float) -> Spend | str:
        """Hold one shadow call on the tenant's share (if bounded), then on the operator's budget;
        the skip reason if either refuses (and nothing held)."""
        gates = [HandoffGate(self.ledger, self.settings.operator, self.limits, allowed=True)]
        if self.tenant_limits is not None:
            gates.insert(0, HandoffGate(self.ledger, share_ledger(self.settings.operator, tenant), self.tenant_limits,
                                        allowed=True))
        spend = Spend()
        for gate in gates:
            reservation = await gate.reserve(tokens, cost_usd, ttl_s=ttl_s)
            if reservation is None:
                await spend.release()
                if gate.refusal != "budget_exhausted":
                    return "store"
                return "budget" if gate.tenant == self.settings.operator else "tenant_share"
            spend.held.append((gate, reservation))
        return spend

    async def _compare(self, lane: Lane, case: ShadowCase, direct: str, direct_cost: float) -> bool:
        fmt = lane.routing.shadow.format
        fmt = answer_format(direct) if fmt == "auto" else fmt
        agreed = same_answer(direct, case.answer, fmt)  # read in the upstream's answer's format: the reference
        outcome = "agree" if agreed else "disagree"
        if not lane.governs(case):
            self.counts["overridden_samples", lane.name, outcome] += 1
            counts = sample_counts(case.tenant, fmt, agreed, case.routed_cost, direct_cost, OVERRIDDEN)
            await self._write(lane, counts, sampled=case)
            return agreed
        self.counts["samples", lane.name, outcome] += 1
        if self.tenant_labels:
            self.counts["tenant_samples", lane.name, case.tenant, outcome] += 1
        self.counts["cost", lane.name, "routed"] += case.routed_cost
        self.counts["cost", lane.name, "upstream_only"] += direct_cost
        if lane.learner is not None:
            await self._learn(lane, case, direct, fmt, agreed, direct_cost)
        in_bucket = {"samples": 1.0, "agreed": float(agreed)}
        await self._write(lane, sample_counts(case.tenant, fmt, agreed, case.routed_cost, direct_cost), in_bucket,
                          case)
        if lane.controller is not None:
            await self._steer(lane, case.tenant, agreed)
        return agreed

    async def _learn(self, lane: Lane, case: ShadowCase, direct: str, fmt: str, agreed: bool,
                     direct_cost: float) -> None:
        """Count the sample under the learned check's version routing now (the measured agreement
        and cost), and keep the example of an answer that was rated (learning.py)."""
        learner = lane.learner
        prefix = check_version_prefix(learner.version)
        sampled = {"samples": 1.0, "agreed": float(agreed), "routed_cost": case.routed_cost, "upstream_cost": direct_cost}
        self._pending[lane.name].update({prefix + key: value for key, value in sampled.items()})
        if case.local is None:
            return
        local_agreed = same_answer(direct, cut_at_stop(case.local.text, case.stop), fmt)
        try:
            self.store_calls["write"] += 1
            if await learner.add(self.ledger.store, case, case.local, local_agreed, fmt):
                self.counts["examples", lane.name] += 1
        except StoreUnavailable:
            self.counts["skipped", lane.name, "store"] += 1

    async def _write(self, lane: Lane, counts: Mapping[str, float], in_bucket: Mapping[str, float] | None = None,
                     sampled: ShadowCase | None = None) -> None:
        """Add `counts` (and `in_bucket` to the timeline's bucket) and the pending ones to the store;
        pending ones that fail wait for the next write, and the sample of `sampled` is a skip."""
        pending, self._pending[lane.name] = self._pending[lane.name], Counter()
        pending.update(counts)
        bucket = int(time.time() // self.settings.bucket_s)
        self.store_calls["write"] += 1
        try:
            await self.ledger.store.quality_add(lane.name, pending, bucket, in_bucket, self.settings.history_s)
        except StoreUnavailable:
            self._pending[lane.name].update(pending)  # a lost reply may count these twice: figures, not money
            if sampled is not None:
                self._skip(lane, "store", sampled)

    async def _steer(self, lane: Lane, tenant: str, agreed: bool) -> None:
        controller, store = lane.controller, self.ledger.store
        try:
            if not await self._within_share(lane, tenant):
                return
            self.store_calls["write"] += 1
            window = await store.knob_window(lane.knob, agreed, controller.knob.window)
            if window and lane.tenant_cap is not None:
                self.store_calls["write"] += 1
                await store.knob_move(lane.knob + WINDOWS, 0.0, 1.0, 0.0, float(2**52))  # a new window begins
            delta = controller.delta(window[1], window[0]) if window else 0.0
            if not delta:
                return
            self.store_calls["write"] += 1
            before, after = await store.knob_move(lane.knob, lane.start, delta,
                                                  controller.knob.floor, controller.knob.ceiling)
        except StoreUnavailable:
            return
        lane.steer(after)
        if after == before:
            log.info("quality knob of alias %s held at its bound %s", lane.name, after)
            return
        self.counts["moves", lane.name, "up" if after > before else "down"] += 1
        log.info("quality knob of alias %s moved %s %s -> %s", lane.name, controller.knob.field, before, after,
                 extra={"alias": lane.name, "knob": controller.knob.field, "before": before, "after": after,
                        "window_samples": window[0], "window_agreed": window[1], "target": controller.target})

    async def _within_share(self, lane: Lane, tenant: str) -> bool:
        """Whether `tenant` may put one more sample into the knob's current window: at most
        `lane.tenant_cap` of each (half, rounded up), so a window needs samples of two tenants or
        more and no tenant moves the knob alone; a tenant's samples past it still count in the
        figures. Pooled over replicas with the store's knob calls: `WINDOWS` counts the knob's full
        windows, and each tenant's count is one knob value, `windows * (cap + 1) + count`, moved up
        by one within this window's bounds: a count left from an earlier window lies below them and
        starts again at 1, and a tenant at the cap does not move."""
        if lane.tenant_cap is None:
            return True
        store = self.ledger.store
        self.store_calls["read"] += 1
        base = (await store.knob_read(lane.knob + WINDOWS) or 0.0) * (lane.tenant_cap + 1)
        self.store_calls["write"] += 1
        before, after = await store.knob_move(f"{lane.knob}:t:{tenant}", base, 1.0, base + 1, base + lane.tenant_cap)
        return after > before

    def _note(self, lane: Lane, case: ShadowCase, name: str) -> None:
        prefix = "" if lane.governs(case) else OVERRIDDEN
        if not prefix:
            self.counts[name, lane.name] += 1
        self._pending[lane.name].update({prefix + name: 1, prefix + tenant_prefix(case.tenant) + name: 1})

    def _skip(self, lane: Lane, reason: str, case: ShadowCase) -> None:
        self.counts["skipped", lane.name, reason] += 1
        prefix = "" if lane.governs(case) else OVERRIDDEN
        self._pending[lane.name][f"{prefix}skip:{reason}"] += 1


WINDOWS = ":windows"  # after a knob's name: the store's count of its full windows (see `_within_share`)
