"""A request's routing: the alias's routing settings with the tenant's and the request's overrides
applied, and the policy they build; refused with a 400 naming the field when they could not run."""

from __future__ import annotations

from pydantic import ValidationError

from gateway.api.errors import InvalidRequest
from gateway.settings import RoutingOverride, RoutingSettings, draft_problem
from policies import THRESHOLD_POLICIES, Policy, Router, SharedWindows, build_policy
from policies.learned import RouterError


def resolve_routing(alias: RoutingSettings, *overrides: RoutingOverride | None, priced: bool = True) -> RoutingSettings:
    """The alias's routing with the tenant's and then the request's overrides applied.

    A policy that needs a threshold (or a target) must bring one unless it is the alias's own
    policy, and a draft needs what can end it (`priced`: the upstream has prices); errors name
    the field as `routing.<field>`.
    """
    merged = alias.model_dump()
    for override in overrides:
        if override is None:
            continue
        changes = override.model_dump(exclude_none=True)
        if changes.get("policy", merged["policy"]) != merged["policy"]:
            merged.update(threshold=None, target_fraction=None)
        merged.update(changes)
        if merged["policy"] == "learned" and "target_fraction" in changes and "threshold" not in changes:
            merged["threshold"] = None  # a share asked for replaces a score threshold set below it
        if changes.get("threshold_from") == "traffic" and (merged["policy"] != "learned" or merged["threshold"] is not None):
            raise InvalidRequest("routing.threshold_from 'traffic' applies to policy 'learned' with a target_fraction, "
                                 "not a threshold", param="routing.threshold_from")
    policy = merged["policy"]
    if policy in (*THRESHOLD_POLICIES, "first") and merged["threshold"] is None:
        raise InvalidRequest(f"routing policy '{policy}' needs a threshold", param="routing.threshold")
    if policy == "target_fraction" and merged["target_fraction"] is None:
        raise InvalidRequest("routing policy 'target_fraction' needs target_fraction", param="routing.target_fraction")
    if policy == "learned" and merged["router"] is None:
        raise InvalidRequest("routing policy 'learned' needs a router, and this model has none", param="routing.policy")
    if policy == "learned" and merged["threshold"] is None and merged["target_fraction"] is None:
        raise InvalidRequest("routing policy 'learned' needs a threshold or target_fraction", param="routing.threshold")
    if merged["escalate_below"] and merged["answer_check"] is None:
        raise InvalidRequest("routing.escalate_below needs an answer check, and this model has none",
                             param="routing.escalate_below")
    problem = draft_problem(merged, priced)
    if problem:
        raise InvalidRequest(f"routing.{problem}", param="routing.escalation")
    try:
        return RoutingSettings(**merged)
    except ValidationError as exc:  # what is left after the checks above: first's whole-number threshold
        raise InvalidRequest(exc.errors()[0]["msg"].removeprefix("Value error, "), param="routing.threshold") from exc


def policy_of(routing: RoutingSettings, router: Router | None, windows: SharedWindows) -> Policy:
    """The policy `routing` names, reading `router` and `windows` (one tenant's recent values on
    the alias); a target_fraction outside the shares the router was fitted for is a 400."""
    try:
        return build_policy(routing.policy, routing.threshold, routing.target_fraction, routing.max_upstream_tokens,
                            routing.max_upstream_share, routing.max_upstream_calls, windows=windows, router=router,
                            threshold_from=routing.threshold_from, answer_value=routing.answer_value,
                            early_escalation=routing.early_escalation)
    except RouterError as exc:
        raise InvalidRequest(str(exc), param="routing.target_fraction") from exc
