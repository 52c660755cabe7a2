"""Evaluation configurations, named as on the command line and in file names.

    local                 local only (policy never)
    upstream              upstream only: policy always with span = max_tokens, i.e. the large
                          model asked once for the whole answer, billed as a client would be
    oracle                route exactly the steps where the local greedy token differs from the
                          upstream's (see fitting/oracle.py)
    entropy@T, top1@T, margin@T, target_fraction@F
                          token-level routing with the gateway's own policies, span 1, no caps
    learned@S             the learned router (--router) at its threshold fitted for share S
    learned@S,from=traffic
                          ... at the S quantile of its recent scores on the config's own items
    first@K               route the first K answer tokens only
    ...,span=N,until=R    the same with up to N upstream tokens per hand-off, cut at the first
                          word / line / sentence boundary when R is given (gateway/decoding/spans.py)
    ...,value=V           price-aware (routing.answer_value V, early escalation on), priced with
                          the run's --decision-sheet
    ...,ceiling=R[,on=escalate]
                          a cost ceiling (routing.max_cost_ratio R; on_ceiling local unless given)
    ...,escalation=afresh an escalated answer is asked of the upstream afresh instead of continued
                          (routing.escalation; answers are held, as a request that does not stream)
    ...,value=V,escalation=draft
                          ... and no hand-off is made before it escalates: the local model drafts
                          the answer, the hand-offs the router wants only counted
    local,afresh=P  <policy>@<value>,...,afresh=P
                          the answer check (--check) asks the upstream afresh for an answer whose
                          chance of being correct is below P (routing.escalate_below P)
    local,agree=K[,keep=majority][,afresh=P]
                          the agreement check instead (routing.answer_check {kind: agreement,
                          samples: K}): each answer's agreement is recorded; below P it is asked afresh;
                          keep=majority keeps the majority's answer (answer: majority)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import yaml

from gateway.settings import Escalation, OnCeiling, SpanRule, ThresholdSource
from policies import THRESHOLD_POLICIES, Policy, Router, SharedWindows, build_policy

ROUTED = (*THRESHOLD_POLICIES, "target_fraction", "learned", "first")
# the gateway's own choices for these routing fields, so the two never drift apart
SPAN_RULES, ON_CEILING = get_args(SpanRule), get_args(OnCeiling)
ESCALATIONS, THRESHOLD_SOURCES = get_args(Escalation), get_args(ThresholdSource)


@dataclass(frozen=True)
class ConfigSpec:
    """One configuration: `policy` is never/always/oracle or a routing policy with `value`."""

    name: str
    policy: str
    value: float | None = None
    span_tokens: int = 1
    until: str = "tokens"
    answer_value: float | None = None
    max_cost_ratio: float | None = None
    on_ceiling: str = "local"
    escalation: str = "continue"  # how an escalated answer is finished: continue | afresh | draft
    escalate_below: float | None = None  # the answer check's bar (afresh=P)
    threshold_from: str = "router"  # learned: the router's fitted threshold, or traffic's (from=traffic)
    agree: int | None = None  # the agreement check's samples (agree=K), instead of the --check file
    keep: str = "greedy"  # the answer the agreement check keeps (keep=majority)
    # the recent values thresholds calibrate on, shared by all items of the config as the gateway
    # shares them by all requests of a tenant on an alias
    windows: SharedWindows = field(default_factory=SharedWindows, compare=False, repr=False)

    @property
    def uses_upstream(self) -> bool:
        return self.policy != "never" or self.escalate_below is not None

    @property
    def family(self) -> str:
        """What the report groups points by: local, upstream, oracle, afresh or the policy's name."""
        if self.policy == "never" and self.escalate_below is not None:
            return "afresh"
        if self.agree is not None:
            return "agree"
        return {"never": "local", "always": "upstream"}.get(self.policy, self.policy)

    def span(self, max_tokens: int) -> int:
        return max_tokens if self.policy == "always" else self.span_tokens

    def policy_object(self, router: Router | None = None) -> Policy:
        """A fresh policy for one item (the oracle is built per item by the runner instead)."""
        if self.policy == "oracle":
            raise ValueError("the oracle needs the item's reference; see fitting.oracle")
        if self.policy == "target_fraction":
            return build_policy("target_fraction", target_fraction=self.value, windows=self.windows,
                                answer_value=self.answer_value)
        if self.policy == "learned":
            if router is None:
                raise ValueError(f"config {self.name} needs a router: pass --router")
            return build_policy("learned", target_fraction=self.value, router=router, windows=self.windows,
                                threshold_from=self.threshold_from, answer_value=self.answer_value)
        return build_policy(self.policy, threshold=self.value, answer_value=self.answer_value)


def _local_checked(text: str, options: list[str]) -> ConfigSpec:
    """'local,afresh=P', or 'local,agree=K' with ',keep=majority' and ',afresh=P' optional."""
    given = dict(option.partition("=")[::2] for option in options)
    if not given or set(given) - {"afresh", "agree", "keep"} or not given.get("agree", "2").isdigit() \
            or not 2 <= int(given.get("agree", "2")) <= 8 or given.get("keep", "majority") != "majority" \
            or ("keep" in given and "agree" not in given):
        raise ValueError(f"bad config {text!r}: local takes afresh=<P>, agree=<samples, 2 to 8> and, with agree, "
                         "keep=majority")
    below = _afresh(text, "afresh=" + given["afresh"]) if "afresh" in given else None
    return ConfigSpec(text, "never", escalate_below=below, agree=int(given["agree"]) if "agree" in given else None,
                      keep=given.get("keep", "greedy"))


def parse_config(text: str) -> ConfigSpec:
    """'local[,afresh=P]' | 'upstream' | 'oracle' | '<policy>@<value>[,span=N][,until=R]...' ->
    ConfigSpec; ValueError otherwise."""
    fixed = {"local": "never", "upstream": "always", "oracle": "oracle"}
    if text in fixed:
        return ConfigSpec(text, fixed[text])
    head, *options = text.split(",")
    if head == "local" and options:
        return _local_checked(text, options)
    policy, sep, value = head.partition("@")
    if not sep or policy not in ROUTED:
        raise ValueError(f"bad config {text!r}: use local, upstream, oracle or <{'|'.join(ROUTED)}>@<value>")
    number = float(value)
    if policy in ("target_fraction", "learned") and not 0 < number <= 1:
        raise ValueError(f"bad config {text!r}: a target share is in (0, 1]")
    given = dict(option.partition("=")[::2] for option in options)
    if set(given) - {"span", "until", "value", "ceiling", "on", "escalation", "afresh", "from"} \
            or given.get("until", "tokens") not in SPAN_RULES or given.get("on", "local") not in ON_CEILING \
            or given.get("escalation", "continue") not in ESCALATIONS \
            or (given.get("escalation") == "draft" and "value" not in given) \
            or given.get("from", "router") not in THRESHOLD_SOURCES or ("from" in given and policy != "learned"):
        raise ValueError(f"bad config {text!r}: options are span=<tokens>, until=<{'|'.join(SPAN_RULES)}>, "
                         f"value=<answer value>, ceiling=<cost ratio>, on=<{'|'.join(ON_CEILING)}>, "
                         f"escalation=<{'|'.join(ESCALATIONS)}> (draft with value), afresh=<P> and "
                         f"(learned only) from=<{'|'.join(THRESHOLD_SOURCES)}>")
    value, ceiling = given.get("value"), given.get("ceiling")
    return ConfigSpec(text, policy, number, int(given.get("span", 1)), given.get("until", "tokens"),
                      None if value is None else float(value), None if ceiling is None else float(ceiling),
                      given.get("on", "local"), given.get("escalation", "continue"),
                      _afresh(text, "afresh=" + given["afresh"]) if "afresh" in given else None, given.get("from", "router"))


def _afresh(text: str, option: str) -> float:
    below = float(option.removeprefix("afresh="))
    if not 0 <= below <= 1:
        raise ValueError(f"bad config {text!r}: afresh=<P> is a probability in [0, 1]")
    return below


def configs_from_snippet(path: Path, keys: list[str] | None = None) -> list[ConfigSpec]:
    """The routings of a `python -m eval calibrate` snippet (only `keys`, if given), as configs."""
    entries = yaml.safe_load(Path(path).read_text())
    missing = [key for key in keys or [] if key not in entries]
    if missing:
        raise ValueError(f"{path} has no entries {', '.join(missing)}; it has {', '.join(entries)}")
    specs = []
    for key, entry in entries.items():
        if keys and key not in keys:
            continue
        routing = entry["routing"]
        value = routing.get("threshold", routing.get("target_fraction"))
        specs.append(parse_config(f"{routing['policy']}@{value}"))
    return specs


def ordered(specs: list[ConfigSpec]) -> list[ConfigSpec]:
    """Unique configs, with `upstream` added before `oracle` (the oracle needs its answers)."""
    seen: dict[str, ConfigSpec] = {}
    for spec in specs:
        if spec.policy == "oracle" and "upstream" not in seen:
            seen["upstream"] = parse_config("upstream")
        seen.setdefault(spec.name, spec)
    return list(seen.values())
