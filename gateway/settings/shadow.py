"""The shadow branch of the settings tree: an alias's `routing.shadow`, `routing.quality_target` and
`routing.knob`, a tenant's `shadow` override, and the top-level `shadow` section (the operator's
budget, the queue, the timeline), loaded with the rest of the tree (gateway/settings/__init__.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.agreement import AnswerFormat

KnobField = Literal["threshold", "target_fraction", "escalate_below"]
# threshold policies whose threshold buys agreement when lowered (they route when a signal is ABOVE it)
LOWER_BUYS_QUALITY = frozenset({"entropy", "learned"})
RAISE_BUYS_QUALITY = frozenset({"top1", "margin", "first"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShadowSettings(_Strict):
    """`aliases.<key>.routing.shadow`: ask the upstream directly for a sampled share of answers."""

    rate: float = Field(..., gt=0, le=1, description="Share of the alias's token-level answers (n = 1, no grammar) "
                        "that the upstream is also asked directly, in the background after the client has the "
                        "whole answer, to compare (docs/routing.md#shadow-answers).")
    format: AnswerFormat = Field(
        "auto", description="How the two answers are compared (policies/agreement.py): auto (by the upstream's "
        "answer), code, letter, number or text (word-set Jaccard >= 0.6).")
    sampling: Literal["request", "greedy"] = Field(
        "request", description="The shadow call's sampling: request (the request's temperature, top_p and seed) or "
        "greedy (temperature 0).")


class KnobSettings(_Strict):
    """`aliases.<key>.routing.knob`: the routing field a quality target moves, and its bounds."""

    field: KnobField = Field(..., description="The routing field the controller moves: threshold (threshold "
                             "policies), target_fraction or escalate_below.")
    floor: float = Field(..., description="Lowest value the controller sets.")
    ceiling: float = Field(..., description="Highest value the controller sets.")
    step: float = Field(..., gt=0, description="How far one move goes.")
    window: int = Field(50, ge=5, le=100_000, description="Shadow samples (pooled over replicas) per decision; where "
                        "two or more tenants can feed it, one tenant's fill at most half of each (rounded up).")
    dead_band: float = Field(0.03, ge=0, lt=0.5, description="No move while a window's agreement is within this "
                             "of the target (hysteresis).")
    more_quality: Literal["raise", "lower"] | None = Field(
        None, description="Which way of the knob buys agreement; null: by the field and policy (threshold: lower "
        "for entropy and learned, raise for top1, margin and first; target_fraction and escalate_below: raise).")

    @model_validator(mode="after")
    def _bounds(self) -> "KnobSettings":
        if not self.floor < self.ceiling:
            raise ValueError(f"knob floor {self.floor} must be below its ceiling {self.ceiling}")
        if self.step > self.ceiling - self.floor:
            raise ValueError(f"knob step {self.step} is wider than floor..ceiling")
        low, high = {"target_fraction": (0.0, 1.0), "escalate_below": (0.0, 1.0)}.get(self.field, (-1e6, 1e6))
        if self.floor < low or self.ceiling > high:
            raise ValueError(f"knob {self.field} must stay within [{low}, {high}]")
        return self

    def quality_sign(self, policy: str) -> int | None:
        """+1 if raising the knob buys agreement (more upstream), -1 if lowering it does; None when
        the field and policy do not say (then `more_quality` must)."""
        if self.more_quality is not None:
            return 1 if self.more_quality == "raise" else -1
        if self.field in ("target_fraction", "escalate_below"):
            return 1
        if policy in LOWER_BUYS_QUALITY:
            return -1
        return 1 if policy in RAISE_BUYS_QUALITY else None


class TenantShadow(_Strict):
    """`tenants[].shadow`: `off` (never sample this tenant's requests) or `{rate: r}` (its own rate)."""

    rate: float = Field(..., ge=0, le=1, description="Share of this tenant's answers shadowed (0: none).")

    @model_validator(mode="before")
    @classmethod
    def _off(cls, data: Any) -> Any:
        return {"rate": 0.0} if data is False or data == "off" else data  # YAML reads a bare `off` as false


class ShadowBudget(_Strict):
    upstream_tokens: int | None = Field(None, ge=0, description="Billed shadow tokens per window.")
    upstream_cost_usd: float | None = Field(None, ge=0, description="Shadow cost per window.")


class OperatorShadowSettings(_Strict):
    """The top-level `shadow` section: who pays for shadow calls and how many may wait."""

    operator: str = Field("shadow-operator", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                          description="Ledger id that shadow calls are reserved and settled against (never a "
                          "client's tenant; GET /admin/quality shows its windows).")
    daily: ShadowBudget = Field(default_factory=ShadowBudget, description="The operator's shadow budget per UTC day.")
    monthly: ShadowBudget = Field(default_factory=ShadowBudget,
                                  description="The operator's shadow budget per UTC month.")
    queue: int = Field(8, ge=1, le=1024, description="Sampled answers that may wait for a shadow call; past it "
                       "they are skipped (reason queue).")
    workers: int = Field(1, ge=1, le=16, description="Shadow calls made at once.")
    max_tokens: int = Field(256, ge=1, le=100_000, description="Most tokens one shadow call asks for, whatever the "
                            "client's max_tokens; a shadow answer cut here while the routed answer could run longer "
                            "is not compared (skip reason length).")
    tenant_share: float = Field(0.25, gt=0, le=1, description="The most of the operator's daily and monthly shadow "
                                "budget that one tenant's requests may spend (past it they are skipped, reason "
                                "tenant_share; 1, or a configuration of one tenant: no per-tenant bound).")
    bucket_s: int = Field(60, ge=10, le=3600, description="Width of the timeline's buckets (seconds).")
    history_s: int = Field(86_400, ge=60, le=30 * 86_400, description="How long the timeline's buckets are kept.")
    refresh_s: float = Field(5.0, gt=0, le=300, description="How often a replica reads the pooled figures and knob "
                             "values from the store.")
    tenant_labels: int = Field(8, ge=0, le=64, description="Shadow metrics carry a tenant label only while the "
                               "gateway has at most this many tenants (0: never).")


def quality_problem(shadow: ShadowSettings | None, target: float | None, knob: KnobSettings | None,
                    learns: bool = False) -> str | None:
    """Why an alias's quality target could never run (None: it can, or there is none); `learns`:
    the alias's `learn` holds the target (gateway/settings/learning.py), not a knob."""
    if learns:
        return "learn and knob are two ways to hold a quality_target: give one" if knob is not None else None
    if target is None and knob is None:
        return None
    if target is None or knob is None:
        return "quality_target and knob go together"
    if shadow is None:
        return "quality_target needs shadow answers (routing.shadow) to measure agreement"
    return None
