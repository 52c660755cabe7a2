"""`aliases.<key>.routing.learn`: routing that learns on its own traffic (docs/routing.md, "Routing
that learns"). The alias's shadow samples become labelled examples; an answer check is fitted on
them in the background and held to the alias's `quality_target`. Loaded with the rest of the tree
(gateway/settings/__init__.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ColdStart = Literal["upstream", "agreement"]


class LearnSettings(BaseModel):
    """How an alias learns its answer check from its shadow samples. `learn: on` takes every default."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Learn (false: the alias routes as configured, and keeps no examples).")
    cold_start: ColdStart = Field(
        "upstream", description="What the alias runs until a learned check is promoted (and after one decays): "
        "upstream (every answer that does not stream is asked of the upstream afresh: upstream-only quality) or "
        "agreement (the agreement check: the greedy answer and 3 samples, asked afresh below 0.75).")
    min_examples: int = Field(120, ge=20, le=100_000, description="Examples (pooled over replicas) before the "
                              "first check is fitted; the alias runs its cold start until then.")
    held_out: float = Field(0.3, ge=0.1, le=0.5, description="Share of the examples never fitted on (chosen by "
                            "each example's id): a new check's ranking (AUC) and its bar are measured on them.")
    keep: int = Field(2000, ge=50, le=100_000, description="Examples kept per alias and local model (the newest).")
    refit_every: int = Field(40, ge=1, le=100_000, description="New examples between two fits.")
    refit_s: float = Field(10.0, gt=0, le=3600, description="How often the background worker looks for new "
                           "examples and reads the promoted check from the store.")
    learning_rate: float = Field(1.0, gt=0, le=1, description="Shadow rate while no check is promoted (the "
                                 "alias's routing.shadow.rate once one is); the operator's shadow budget bounds both.")
    tenant_share: float = Field(0.5, gt=0, le=1, description="The most of an alias's examples one tenant's requests "
                                "may give, where two or more tenants can feed it (past it their samples still count "
                                "in the figures).")
    decay_auc: float = Field(0.55, ge=0, lt=1, description="A promoted check whose ranking (AUC) on the examples "
                             "that came after its promotion falls below this is dropped: the alias runs its cold "
                             "start and learns again from the examples after the drop.")
    live_window: int = Field(60, ge=10, le=100_000, description="Examples after a promotion (the newest) that its "
                             "live ranking is measured on.")

    @model_validator(mode="before")
    @classmethod
    def _switch(cls, data: Any) -> Any:
        if data is True or data == "on":
            return {}
        if data is False or data == "off":  # YAML reads bare on/off as booleans
            return {"enabled": False}
        return data


def learn_problem(learn: LearnSettings | None, shadow: Any, target: float | None) -> str | None:
    """Why an alias's `learn` could never run (None: it can, or it is off)."""
    if learn is None or not learn.enabled:
        return None
    if shadow is None:
        return "learn needs shadow answers (routing.shadow): they are its labels"
    if target is None:
        return "learn needs a quality_target: the agreement with upstream-only its bar holds"
    return None
