"""What every routing policy sees and says."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from policies.window import SharedWindows

if TYPE_CHECKING:
    from policies.learned import Router
    from policies.mlp_router import MlpRouter


class Route(enum.Enum):
    LOCAL = "local"
    UPSTREAM = "upstream"


@dataclass(frozen=True)
class Signal:
    """The local model's uncertainty at one decoding step."""

    entropy: float  # nats
    top1: float  # probability of the most likely token
    margin: float  # top-1 minus top-2 probability
    position: int  # index of this token in the answer
    top: tuple[float, ...] = ()  # the largest probabilities, largest first (four in a detailed signal)
    kind: str = ""  # detailed: what the most likely token is (word, piece, digit, punct, newline)
    # the local model's last hidden state (numpy float32), only for a policy that reads_hidden
    hidden: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class RoutingState:
    """What the decoder knows about the answer so far, handed to the policy as plain values."""

    answer_tokens: int = 0
    upstream_tokens: int = 0
    upstream_calls: int = 0
    drafted_calls: int = 0  # hand-offs a draft wanted and did not make (escalation: draft); not calls, for caps
    budget_tokens_left: int | None = None  # None: no token budget applies
    handoff_cost_tokens: int = 0  # estimated billed tokens of the next hand-off
    # Predicted prices (USD, the upstream's price sheet; all 0 without one, for a free upstream, or
    # for a policy that does not read them):
    handoff_price_usd: float = 0.0  # of the next hand-off, reading what its prefix may from a cache
    direct_price_usd: float = 0.0  # of asking the upstream directly for the whole answer
    rest_price_usd: float = 0.0  # of the upstream writing the rest of the answer in one call
    rest_tokens: int = 0  # answer tokens still expected (recent answers as long; else all still allowed)


@dataclass(frozen=True)
class Decision:
    """Where one step goes. For an upstream step, `room` is the most tokens the upstream may write
    (None: as many as the request's span), `escalate` hands the rest of the answer over in one call,
    and `need` is the policy's chance that the hand-off is needed (None: it has no such estimate);
    for a local one, `vetoed` says what turned an upstream step local ("cap", "budget" when the
    tenant's budget would not cover it, "price" when the hand-off was not worth its price).
    `decisive`: a short answer's hand-off, weighed against asking directly and made even in a
    draft (policies.price)."""

    route: Route
    room: int | None = None
    vetoed: str | None = None
    escalate: bool = False
    need: float | None = None
    decisive: bool = False

    @property
    def upstream(self) -> bool:
        return self.route is Route.UPSTREAM


LOCAL = Decision(Route.LOCAL)
UPSTREAM = Decision(Route.UPSTREAM)


class Policy(Protocol):
    """A small value with no I/O: given a step's signal and the answer's state, say where the step
    goes. What the decoder needs to know of a policy besides `decide` is declared here:

    - `detailed_signal`: it reads `Signal.top` beyond two entries or `Signal.kind`, which the
      decoder computes only then (they cost a pass over the vocabulary every step);
    - `routes`: it may send a step upstream at all (False: the decoder never prepares a hand-off);
    - `wants_warm_up`: a warm-up call that reads the prompt into the upstream's cache ahead of the
      first hand-off can help (not when every step is a hand-off anyway);
    - `reads_hidden`: it reads `Signal.hidden`, which the engine returns only for sequences that
      ask for it (a decode with embeddings on);
    - `reads_prices`: it reads the predicted prices of `RoutingState`, which the decoder fills in
      only then (0 otherwise).
    """

    name: str
    detailed_signal: bool
    routes: bool
    wants_warm_up: bool
    reads_hidden: bool
    reads_prices: bool

    def decide(self, signal: Signal, state: RoutingState) -> Decision: ...


class PolicyDefaults:
    """The usual answers to the protocol's questions; a policy overrides what differs."""

    detailed_signal = False
    routes = True
    wants_warm_up = True
    reads_hidden = False
    reads_prices = False


class Wrapping:
    """A policy around an `inner` one that declares what the inner policy declares."""

    inner: Policy

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def detailed_signal(self) -> bool:
        return self.inner.detailed_signal

    @property
    def routes(self) -> bool:
        return self.inner.routes

    @property
    def wants_warm_up(self) -> bool:
        return self.inner.wants_warm_up

    @property
    def reads_hidden(self) -> bool:
        return self.inner.reads_hidden

    @property
    def reads_prices(self) -> bool:
        return self.inner.reads_prices


@dataclass(frozen=True)
class PolicyArgs:
    """What a policy's constructor is handed for one request: the routing fields a policy may read
    (named as in the configuration) and what the gateway owns for it (a tenant's `windows` on the
    alias, None: fresh ones; the alias's learned `router`)."""

    threshold: float | None = None
    target_fraction: float | None = None
    threshold_from: str = "router"
    router: Router | MlpRouter | None = None
    windows: SharedWindows | None = None


@dataclass(frozen=True)
class Needs:
    """What a policy cannot run without: one of the routing `fields`, named `what` in errors
    ("a threshold"). Where there are several the policy reads the first one given, so an override
    that gives a later one clears those before it that were set below it."""

    fields: tuple[str, ...]
    what: str


@dataclass(frozen=True)
class PolicyEntry:
    """A policy as the configuration names it, in policies.registry.POLICIES.

    `build` makes a fresh one for one request. The settings fill the routing fields a
    configuration leaves unset from `defaults`, refuse a routing that lacks one of `needs`, and
    refuse one in which `check` finds a problem: (the field, why: "needs a whole number ...").
    """

    name: str
    build: Callable[[PolicyArgs], Policy]
    needs: tuple[Needs, ...] = ()
    check: Callable[[Mapping[str, Any]], tuple[str, str] | None] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
