"""A request's routing: the alias's routing settings with the tenant's and the request's overrides
applied, and the policy they build; refused with a 400 naming the field when they could not run."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from gateway.settings import RoutingOverride, RoutingSettings, draft_problem
from gateway.wire.errors import InvalidRequest
from policies import POLICIES, Policy, Router, SharedWindows, build_policy
from policies.learned import RouterError


def resolve_routing(alias: RoutingSettings, *overrides: RoutingOverride | None, priced: bool = True) -> RoutingSettings:
    """The alias's routing with the tenant's and then the request's overrides applied.

    A policy that needs a threshold (or a target) must bring one unless it is the alias's own
    policy, and a draft needs what can end it (`priced`: the upstream has prices); errors name
    the field as `routing.<field>`.
    """
    merged = alias.model_dump(exclude={"preset"})  # expanded already: its values must not fill what an override clears
    for override in overrides:
        if override is None:
            continue
        changes = override.model_dump(exclude_none=True)
        if changes.get("policy", merged["policy"]) != merged["policy"]:
            merged.update(threshold=None, target_fraction=None)
        merged.update(changes)
        _clear_passed_over(merged, changes)
        if changes.get("threshold_from") == "traffic" and (merged["policy"] != "learned" or merged["threshold"] is not None):
            raise InvalidRequest("routing.threshold_from 'traffic' applies to policy 'learned' with a target_fraction, "
                                 "not a threshold", param="routing.threshold_from")
    _refuse_unmet_needs(merged)
    if merged["escalate_below"] and merged["answer_check"] is None:
        raise InvalidRequest("routing.escalate_below needs an answer check, and this model has none",
                             param="routing.escalate_below")
    problem = draft_problem(merged, priced)
    if problem:
        raise InvalidRequest(f"routing.{problem}", param="routing.escalation")
    entry = POLICIES[merged["policy"]]
    wrong = entry.check(merged) if entry.check else None
    if wrong:
        raise InvalidRequest(f"policy '{entry.name}' {wrong[1]}", param=f"routing.{wrong[0]}")
    try:
        return RoutingSettings(**merged)
    except ValidationError as exc:  # none is expected: the checks above are the settings' own
        raise InvalidRequest(exc.errors()[0]["msg"].removeprefix("Value error, "), param="routing") from exc


def _clear_passed_over(merged: dict[str, Any], changes: dict[str, Any]) -> None:
    """Where one of several fields meets a need of the policy and it reads the first one given, an
    override that gives a later one clears those before it set below it (learned: a share asked
    for replaces a score threshold)."""
    for need in POLICIES[merged["policy"]].needs:
        given = [index for index, key in enumerate(need.fields) if key in changes]
        if given:
            merged.update(dict.fromkeys(need.fields[:given[0]]))


def _refuse_unmet_needs(merged: dict[str, Any]) -> None:
    """A 400 for the first need of the policy that the merged routing leaves unmet, naming the
    field; one that only the configuration sets (learned's router) names the policy instead."""
    policy = merged["policy"]
    for need in POLICIES[policy].needs:
        if any(merged[key] is not None for key in need.fields):
            continue
        if need.fields[0] in RoutingOverride.model_fields:
            raise InvalidRequest(f"routing policy '{policy}' needs {need.what}", param=f"routing.{need.fields[0]}")
        raise InvalidRequest(f"routing policy '{policy}' needs {need.what}, and this model has none",
                             param="routing.policy")


def policy_of(routing: RoutingSettings, router: Router | None, windows: SharedWindows) -> Policy:
    """The policy `routing` names, reading `router` and `windows` (one tenant's recent values on
    the alias); a target_fraction outside the shares the router was fitted for is a 400."""
    try:
        return build_policy(routing.policy, windows=windows, router=router, **vars(routing.policy_rule))
    except RouterError as exc:
        raise InvalidRequest(str(exc), param="routing.target_fraction") from exc
