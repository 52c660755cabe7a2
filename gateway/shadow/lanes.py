"""One alias's lane through the shadow service (gateway/shadow/service.py): its upstream and
routing, its knob's controller, or the learner of its answer check (gateway/shadow/learning.py).

A lane is built for each configuration the runtime serves (`lane_of`). On a reload, an alias whose
local model and routing did not change carries on the running lane: the same learner (its live
check, version and promoted state, which the decoder keeps reading) and the knob's value, so a
reload that did not touch the alias neither starts its learning cold nor moves its knob back.

How many tenants can feed a lane (`feeders`) bounds one tenant's share of its knob windows and of
its examples; the service counts them at each refresh (`Lane.count_feeders`), tenants created
through the admin API included.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from adapters.upstream import Continuations
from gateway.settings import RoutingSettings, TenantSettings
from gateway.shadow.cases import ShadowCase, changes_routing, set_fields
from gateway.shadow.controller import KnobController
from gateway.shadow.learning import CheckLearner, learner_of


@dataclass
class Lane:
    """One alias's shadow state in this process."""

    name: str
    upstream: Continuations
    routing: RoutingSettings  # as configured
    local: Any = None  # the alias's local model (a reload that keeps it and the routing carries the lane on)
    carried: bool = False  # carries on the lane of the service this one replaced (see the module docstring)
    controller: KnobController | None = None
    knob: str = ""  # the knob's name in the Store
    start: float = 0.0  # the knob's value until first moved
    steered: RoutingSettings | None = None  # `routing` with the knob's current value
    tenant_cap: int | None = None  # most samples one tenant puts in a knob window; None: one tenant feeds it
    learner: CheckLearner | None = None  # routing.learn: learns its answer check from the samples

    @property
    def rate(self) -> float:
        """The alias's shadow rate now (a learning alias's is higher until its check is promoted)."""
        own = self.routing.shadow.rate
        return own if self.learner is None else self.learner.rate(own)

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

    def count_feeders(self, feeding: int) -> None:
        """Bound one tenant's share now that `feeding` tenants can feed the lane: with two or more,
        half of each knob window (rounded up) and `learn.tenant_share` of the examples; with one,
        none (a knob or a learner one tenant alone feeds is that tenant's)."""
        shared = feeding > 1
        if self.controller is not None:
            self.tenant_cap = math.ceil(self.routing.knob.window / 2) if shared else None
        if self.learner is not None:
            self.learner.tenant_share = self.routing.learn.tenant_share if shared else None


def lane_of(name: str, alias: Any, settings: Any, running: Lane | None = None) -> Lane | None:
    """The lane of the runtime's alias `name` (None: it does not shadow, or has no upstream to
    ask); `settings`: the whole tree (a new learner hashes the alias's local model file, named
    there: call off the event loop). With `running` (the lane the
    reload replaces), an alias whose local model and routing did not change carries it on (see the
    module docstring). Tenant bounds are set later, by `count_feeders`."""
    routing = alias.settings.routing
    if routing.shadow is None or alias.upstream is None:
        return None
    lane = Lane(name, alias.upstream, routing, alias.local)
    lane.carried = running is not None and running.routing == routing and running.local is alias.local
    if routing.quality_target is not None and routing.knob is not None:  # no target, or `learn` holds it
        configured = getattr(routing, routing.knob.field)
        lane.controller = KnobController(routing.quality_target, routing.knob, routing.knob.quality_sign(routing.policy))
        lane.knob = lane.controller.key(name, routing.policy, configured)
        lane.start = lane.controller.initial(configured)
        if lane.carried:
            lane.steered = running.steered
        else:
            lane.steer(lane.start)
    if routing.learn is not None and routing.learn.enabled:
        gguf = settings.models.local[alias.settings.local].gguf
        lane.learner = running.learner if lane.carried else learner_of(name, routing, gguf)
    return lane


def feeders(tenants: Iterable[TenantSettings], alias: str, routing: RoutingSettings) -> int:
    """How many tenants' samples can feed the alias's knob and examples: those that may use it,
    whose data may leave (allow_upstream), whose shadow is not off, and whose own `routing` leaves
    the alias's as it is."""
    return sum(1 for tenant in tenants
               if tenant.may_use(alias) and tenant.allow_upstream
               and (tenant.shadow is None or tenant.shadow.rate > 0)
               and not changes_routing(routing, [set_fields(tenant.routing)]))
