"""The routing rules a request's policy and decoding read, as values `RoutingSettings` hands out whole.

The settings schema stays flat (`routing.span`, `routing.on_ceiling`, ...); each rule gathers the
fields one concern reads, under the same names, and travels as one value from the settings to what
reads it: `PolicyRule` to `policies.build_policy` (gateway/tenancy/routing.py), the others through
admission into the decoding (gateway/decoding/values.py `RequestRouting`). A field added to a rule
reaches its consumer without being copied at any layer in between.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

from policies.agreement import AgreementCheck
from policies.answer_check import AnswerCheck
from policies.combine import CombineParams

Rule = TypeVar("Rule")


@dataclass(frozen=True)
class PolicyRule:
    """What the routing policy reads beside its name, as `policies.build_policy` takes it by name: its
    threshold (or target share, and where a learned one's threshold comes from), the caps on what it
    hands upstream, and the price terms (answer_value: null, decisions ignore price)."""

    threshold: float | None = None
    target_fraction: float | None = None
    threshold_from: str = "router"
    max_upstream_tokens: int | None = None
    max_upstream_share: float | None = None
    max_upstream_calls: int | None = None
    answer_value: float | None = None
    early_escalation: bool = True


@dataclass(frozen=True)
class HandoffRule:
    """How much one hand-off asks of the upstream: up to `span` tokens, its text kept up to the first
    `span_until` boundary in them (tokens: all of it; else word, line or sentence)."""

    span: int = 1
    span_until: str = "tokens"


@dataclass(frozen=True)
class CombineRule:
    """How a routed step's token is chosen (policies/combine.py): `combine` take (the upstream's
    token), contrastive (`combine_alpha`, `combine_beta`) or fuse (`combine_weight`), from the
    upstream's `combine_alternatives` likeliest tokens, which a combining hand-off asks for."""

    combine: str = "take"
    combine_alpha: float = 0.1
    combine_beta: float = 0.5
    combine_weight: float = 0.5
    combine_alternatives: int = 5

    @property
    def combines(self) -> bool:
        """Whether a routed step weighs the two models' distributions (anything but take)."""
        return self.combine != "take"

    @property
    def alternatives(self) -> int:
        """How many alternatives a hand-off asks the upstream for (0: none, under take)."""
        return self.combine_alternatives if self.combines else 0

    @property
    def params(self) -> CombineParams:
        return CombineParams(self.combine, self.combine_alpha, self.combine_beta, self.combine_weight)


@dataclass(frozen=True)
class CeilingRule:
    """A request's cost ceiling: its hand-offs bill at most `max_cost_ratio` times what asking the
    upstream directly would cost (None: no ceiling, only the report); a hand-off past it becomes
    `on_ceiling`: local (the answer finishes locally) or escalate (the upstream writes the rest)."""

    max_cost_ratio: float | None = None
    on_ceiling: str = "local"


@dataclass(frozen=True)
class AnswerReview:
    """What may become of an answer before it is shown. `answer_check` rates it once it is finished; a
    `held` answer (nothing shown before it is complete: the request does not stream) rated below
    `escalate_below` is asked of the upstream afresh (None: never), and `escalation` says how a held
    answer that escalates is finished: continue, afresh or draft. The default reviews nothing."""

    answer_check: AnswerCheck | AgreementCheck | None = None
    escalate_below: float | None = None
    escalation: str = "continue"
    held: bool = False


def rule_of(kind: type[Rule], source: Any, **given: Any) -> Rule:
    """The rule `kind` with each of its fields read from the attribute of the same name of `source`
    (a RoutingSettings), except those `given`."""
    return kind(**{f.name: getattr(source, f.name) for f in fields(kind) if f.name not in given}, **given)
