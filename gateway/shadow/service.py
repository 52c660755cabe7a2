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
where two or more tenants can feed it, one tenant fills at most half of each window
(`_within_share`), so no tenant moves it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from adapters.store import Limits, Reservation, StoreUnavailable
from adapters.upstream import Continuation, Continuations, UpstreamUnavailable
from gateway.settings import OperatorShadowSettings, RoutingSettings, TenantSettings
from gateway.shadow.cases import ShadowCase, changes_routing, cut_at_stop, set_fields
from gateway.shadow.controller import KnobController
from gateway.shadow.figures import OVERRIDDEN, sample_counts, tenant_prefix
from gateway.tenancy.budget import RESERVATION_MARGIN_S, HandoffGate, Ledger, billed
from policies.agreement import answer_format, same_answer

log = logging.getLogger("gateway.shadow")


@dataclass
class Lane:
    """One alias's shadow state in this process."""

    name: str
    upstream: Continuations
    routing: RoutingSettings  # as configured
    controller: KnobController | None = None
    knob: str = ""  # the knob's name in the Store
    start: float = 0.0  # the knob's value until first moved
    steered: RoutingSettings | None = None  # `routing` with the knob's current value
    tenant_cap: int | None = None  # most samples one tenant puts in a knob window; None: one tenant feeds it

    def governs(self, case: ShadowCase) -> bool:
        """Whether `case` ran the alias's own routing (its sample may feed the knob and the figures)."""
        return not changes_routing(self.routing, case.overrides)

    def steer(self, value: float) -> float:
        """Take the knob's value; returns the value it had before."""
        field = self.controller.knob.field
        before = getattr(self.steered or self.routing, field)
        if value != before or self.steered is None:
            self.steered = self.routing.model_copy(update={field: value})
        return before


class Shadow:
    """Shadow answers for every alias with `routing.shadow` (see the module docstring)."""

    def __init__(self, settings: OperatorShadowSettings, lanes: Mapping[str, Lane], ledger: Ledger,
                 tenant_count: int = 0, rng: random.Random | None = None) -> None:
        self.settings, self.lanes, self.ledger = settings, dict(lanes), ledger
        self.limits = Limits(settings.daily.upstream_tokens, settings.daily.upstream_cost_usd,
                             settings.monthly.upstream_tokens, settings.monthly.upstream_cost_usd)
        # one tenant's bound; None: none (with one tenant, its share would only idle the rest of the budget)
        self.tenant_limits = tenant_share_limits(self.limits, settings.tenant_share) if tenant_count > 1 else None
        self.tenant_labels = 0 < tenant_count <= settings.tenant_labels  # tenant ids become metric labels
        self.queue: asyncio.Queue[tuple[Lane, ShadowCase]] = asyncio.Queue(settings.queue)
        self.rng = rng or random.Random()
        self.counts: Counter[tuple[str, ...]] = Counter()  # this process's events, for /metrics
        self.pooled: dict[str, dict[str, float]] = {}  # each alias's pooled counters, as last read
        self._pending: dict[str, Counter[str]] = {name: Counter() for name in self.lanes}  # not yet in the store
        self.store_calls: Counter[str] = Counter()  # "write", "read": what shadowing costs the store
        self.in_flight = 0

    @classmethod
    def of(cls, settings: Any, aliases: Mapping[str, Any], ledger: Ledger,
           rng: random.Random | None = None) -> "Shadow | None":
        """The service for `settings` (the whole tree) over the runtime's `aliases`, or None when no
        alias shadows."""
        lanes = {}
        for name, alias in aliases.items():
            routing = alias.settings.routing
            if routing.shadow is not None and alias.upstream is not None:
                lanes[name] = _lane(name, alias.upstream, routing, feeders(settings.tenants, name, routing))
        if not lanes:
            return None
        return cls(settings.shadow, lanes, ledger, len(settings.tenants), rng)

    def routing_of(self, alias: str, routing: RoutingSettings) -> RoutingSettings:
        """`routing` (the alias's own) with its knob's current value, if a controller moves one."""
        lane = self.lanes.get(alias)
        return routing if lane is None or lane.steered is None else lane.steered

    def offer(self, case: ShadowCase | None) -> None:
        """Draw `case` by its rate and queue it; never waits (see the module docstring)."""
        lane = self.lanes.get(case.alias) if case is not None else None
        if lane is None:
            return
        rate = lane.routing.shadow.rate if case.tenant_rate is None else case.tenant_rate
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
        """The coroutines to run for the service's life: the workers and the refresher."""
        return [self.work() for _ in range(self.settings.workers)] + [self.refresh()]

    async def work(self) -> None:
        """Run until cancelled: answer queued cases one at a time."""
        while True:
            lane, case = await self.queue.get()
            self.in_flight += 1
            try:
                await self.answer(lane, case)
            except Exception:  # noqa: BLE001 - one bad case must not stop the worker
                log.exception("shadow answer of alias %s failed", lane.name)
            finally:
                self.in_flight -= 1
                self.queue.task_done()

    async def refresh(self) -> None:
        """Run until cancelled: every `refresh_s`, write pending counts and read the pooled figures
        and knob values, so that every replica steers by the same value."""
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            await self.sync()

    async def sync(self) -> None:
        """Write pending counts, read each alias's pooled counters and knob (store faults: next time)."""
        for lane in self.lanes.values():
            with contextlib.suppress(StoreUnavailable):
                if self._pending[lane.name]:
                    await self._write(lane, {})
                self.store_calls["read"] += 1
                self.pooled[lane.name], _ = await self.ledger.store.quality_read(lane.name)
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
        greedy = lane.routing.shadow.sampling == "greedy"
        call = asyncio.ensure_future(upstream.continue_text(
            handoff, max_tokens, 0.0 if greedy else case.temperature, 1.0 if greedy else case.top_p,
            None if greedy else case.seed, case.extra))
        try:
            got: Continuation = await asyncio.shield(call)
        except UpstreamUnavailable as exc:
            await spend.release()
            log.info("shadow call of alias %s failed: %s", lane.name, exc)
            return self._skip(lane, "failed", case)
        except BaseException:  # shut down mid-call: the upstream bills it all the same
            spend.finish_in_background(call)
            raise
        await spend.settle(got)
        direct = cut_at_stop(got.text, case.stop)
        if max_tokens < case.max_tokens and not got.finished and direct == got.text:
            return self._skip(lane, "length", case)  # cut by shadow.max_tokens, not the routed answer's own limit
        return await self._compare(lane, case, direct, got.cost_usd)

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
        in_bucket = {"samples": 1.0, "agreed": float(agreed)}
        await self._write(lane, sample_counts(case.tenant, fmt, agreed, case.routed_cost, direct_cost), in_bucket,
                          case)
        if lane.controller is not None:
            await self._steer(lane, case.tenant, agreed)
        return agreed

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


@dataclass
class Spend:
    """One shadow call's reservations (the tenant's share, the operator's), settled or released together."""

    held: list[tuple[HandoffGate, Reservation]] = field(default_factory=list)

    async def settle(self, got: Continuation) -> None:
        for gate, reservation in self.held:
            await gate.settle(reservation, billed(got))

    async def release(self) -> None:
        for gate, reservation in self.held:
            await gate.release(reservation)

    def finish_in_background(self, call: asyncio.Future) -> None:
        """Shut down mid-call: each ledger bills what the call reports once it ends (see HandoffGate)."""
        for gate, reservation in self.held:
            gate.finish_in_background(reservation, call, lambda done, g=gate, r=reservation: g.settle(r, billed(done)))


def share_ledger(operator: str, tenant: str) -> str:
    """The ledger id of one tenant's shadow spending: never a client tenant's own (tenant ids hold no ':')."""
    return f"{operator}:{tenant}"


def tenant_share_limits(limits: Limits, share: float) -> Limits | None:
    """`share` of the operator's `limits`, one tenant's bound; None when there is none to share (an
    unlimited operator, or a share of 1)."""
    if limits.unlimited or share >= 1:
        return None

    def tokens(limit: int | None) -> int | None:
        return None if limit is None else int(limit * share)

    def cost(limit: float | None) -> float | None:
        return None if limit is None else limit * share

    return Limits(tokens(limits.day_tokens), cost(limits.day_cost_usd), tokens(limits.month_tokens),
                  cost(limits.month_cost_usd))


def feeders(tenants: Iterable[TenantSettings], alias: str, routing: RoutingSettings) -> int:
    """How many tenants' samples can feed the alias's knob: those that may use it, whose data may
    leave (allow_upstream), whose shadow is not off, and whose own `routing` leaves the alias's as it is."""
    return sum(1 for tenant in tenants
               if tenant.may_use(alias) and tenant.allow_upstream
               and (tenant.shadow is None or tenant.shadow.rate > 0)
               and not changes_routing(routing, [set_fields(tenant.routing)]))


def _lane(name: str, upstream: Continuations, routing: RoutingSettings, feeding: int = 1) -> Lane:
    lane = Lane(name, upstream, routing)
    if routing.quality_target is None:
        return lane
    configured = getattr(routing, routing.knob.field)
    lane.controller = KnobController(routing.quality_target, routing.knob, routing.knob.quality_sign(routing.policy))
    lane.knob = lane.controller.key(name, routing.policy, configured)
    lane.start = lane.controller.initial(configured)
    lane.steer(lane.start)
    if feeding > 1:  # a knob one tenant alone feeds is that tenant's: no share to keep
        lane.tenant_cap = math.ceil(routing.knob.window / 2)
    return lane

