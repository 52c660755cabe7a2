"""The shadow service: draws a share of finished answers, asks the upstream each one directly in
the background, compares the two answers by format, and pools the counts in the Store.

`offer(case)` is called once the client has its whole answer (a response's background task, or a
stream's end) and never waits: it draws by the rate, and queues the case if the upstream's breaker
is closed and the bounded queue has room (else a skip, counted by reason). Workers take cases from
the queue: each shadow call is reserved and settled on the operator's ledger (a HandoffGate of its
own, never the client tenant's), asked with the same prompt, sampling and max_tokens as the routed
answer, and compared; its text is then dropped: only counts reach the Store. An alias with a
quality target feeds each sample into its knob's pooled window; a full window may move the knob
(gateway/shadow/controller.py), and `routing_of` hands the moved value to admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adapters.store import Limits, StoreUnavailable
from adapters.upstream import Continuation, Continuations, UpstreamUnavailable
from gateway.settings import OperatorShadowSettings, RoutingSettings
from gateway.shadow.cases import ShadowCase, cut_at_stop
from gateway.shadow.controller import KnobController
from gateway.shadow.figures import sample_counts, tenant_prefix
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
                lanes[name] = _lane(name, alias.upstream, routing)
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
        self._note(lane, case.tenant, "eligible")
        if self.rng.random() >= rate:
            return
        self._note(lane, case.tenant, "sampled")
        if not lane.upstream.available:
            self._skip(lane, "breaker")
            return
        try:
            self.queue.put_nowait((lane, case))
        except asyncio.QueueFull:
            self._skip(lane, "queue")

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
            return self._skip(lane, "breaker")
        handoff = upstream.text_handoff(case.prompt, case.scope) if case.prompt is not None else \
            upstream.handoff(case.messages, case.continue_final, case.scope)
        if handoff is None:  # raw text, and an upstream that continues chats only
            return self._skip(lane, "unsupported")
        handoff = upstream.with_answer(handoff, "")
        gate = HandoffGate(self.ledger, self.settings.operator, self.limits, allowed=True)
        prompt = upstream.estimate_prompt_tokens(handoff)
        reservation = await gate.reserve(prompt + case.max_tokens, upstream.estimate_cost(prompt, case.max_tokens),
                                         ttl_s=upstream.worst_case_s + RESERVATION_MARGIN_S)
        if reservation is None:
            return self._skip(lane, "budget" if gate.refusal == "budget_exhausted" else "store")
        greedy = lane.routing.shadow.sampling == "greedy"
        call = asyncio.ensure_future(upstream.continue_text(
            handoff, case.max_tokens, 0.0 if greedy else case.temperature, 1.0 if greedy else case.top_p,
            None if greedy else case.seed, case.extra))
        try:
            got: Continuation = await asyncio.shield(call)
        except UpstreamUnavailable as exc:
            await gate.release(reservation)
            log.info("shadow call of alias %s failed: %s", lane.name, exc)
            return self._skip(lane, "failed")
        except BaseException:  # shut down mid-call: the upstream bills it all the same
            gate.finish_in_background(reservation, call, lambda done: gate.settle(reservation, billed(done)))
            raise
        await gate.settle(reservation, billed(got))
        return await self._compare(lane, case, cut_at_stop(got.text, case.stop), got.cost_usd)

    async def _compare(self, lane: Lane, case: ShadowCase, direct: str, direct_cost: float) -> bool:
        fmt = lane.routing.shadow.format
        fmt = answer_format(direct) if fmt == "auto" else fmt
        agreed = same_answer(direct, case.answer, fmt)  # read in the upstream's answer's format: the reference
        self.counts["samples", lane.name, "agree" if agreed else "disagree"] += 1
        if self.tenant_labels:
            self.counts["tenant_samples", lane.name, case.tenant, "agree" if agreed else "disagree"] += 1
        self.counts["cost", lane.name, "routed"] += case.routed_cost
        self.counts["cost", lane.name, "upstream_only"] += direct_cost
        await self._write(lane, sample_counts(case.tenant, fmt, agreed, case.routed_cost, direct_cost), agreed)
        if lane.controller is not None:
            await self._steer(lane, agreed)
        return agreed

    async def _write(self, lane: Lane, counts: Mapping[str, float], agreed: bool | None = None) -> None:
        """Add `counts` and the pending ones to the store; pending ones that fail wait for the next write."""
        pending, self._pending[lane.name] = self._pending[lane.name], Counter()
        pending.update(counts)
        bucket = int(time.time() // self.settings.bucket_s)
        in_bucket = {"samples": 1.0, "agreed": float(agreed)} if agreed is not None else None
        self.store_calls["write"] += 1
        try:
            await self.ledger.store.quality_add(lane.name, pending, bucket, in_bucket, self.settings.history_s)
        except StoreUnavailable:
            self._pending[lane.name].update(pending)  # a lost reply may count these twice: figures, not money
            if agreed is not None:
                self._skip(lane, "store")

    async def _steer(self, lane: Lane, agreed: bool) -> None:
        controller, store = lane.controller, self.ledger.store
        try:
            self.store_calls["write"] += 1
            window = await store.knob_window(lane.knob, agreed, controller.knob.window)
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

    def _note(self, lane: Lane, tenant: str, name: str) -> None:
        self.counts[name, lane.name] += 1
        self._pending[lane.name].update({name: 1, tenant_prefix(tenant) + name: 1})

    def _skip(self, lane: Lane, reason: str) -> None:
        self.counts["skipped", lane.name, reason] += 1
        self._pending[lane.name][f"skip:{reason}"] += 1


def _lane(name: str, upstream: Continuations, routing: RoutingSettings) -> Lane:
    lane = Lane(name, upstream, routing)
    if routing.quality_target is None:
        return lane
    configured = getattr(routing, routing.knob.field)
    lane.controller = KnobController(routing.quality_target, routing.knob, routing.knob.quality_sign(routing.policy))
    lane.knob = lane.controller.key(name, routing.policy, configured)
    lane.start = lane.controller.initial(configured)
    lane.steer(lane.start)
    return lane

