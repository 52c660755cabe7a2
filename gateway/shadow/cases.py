"""What a finished token-level answer hands to the shadow service: the prompt as it was asked, the
routed answer's text and cost, the sampling to ask the upstream with, and the routing overrides it
ran under (a request that ran other routing than the alias's is kept apart: `changes_routing`).
Nothing here is stored: a case lives in the bounded queue until its shadow call is compared, then
it is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanContext

from gateway.traced import request_trace
from policies.answer_check import AnswerStats


@dataclass(frozen=True)
class LocalAnswer:
    """The local answer as its check rated it, before any escalation (a learning alias's example)."""

    stats: AnswerStats
    text: str
    prompt_tokens: int
    agreement: float | None = None  # the agreement check's share of agreeing samples, where it ran


@dataclass(frozen=True)
class ShadowCase:
    alias: str
    tenant: str
    tenant_rate: float | None  # the tenant's own shadow rate (0: off); None: the alias's
    answer: str  # the routed answer's text, as the client got it
    routed_cost: float  # usage.routing.upstream_cost_usd of the routed answer
    max_tokens: int  # the routed answer's token limit, which the shadow call gets too
    messages: list[dict[str, Any]] = field(default_factory=list)  # the chat asked (unless `prompt`)
    prompt: str | None = None  # raw text (legacy completions), continued as plain text
    continue_final: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # penalties, as hand-offs send them
    stop: tuple[str, ...] = ()
    scope: str = "shared"  # the tenant's cache scope: the upstream's prefix cache stays its own
    overrides: tuple[dict[str, Any], ...] = ()  # the fields the tenant's and the request's `routing` set
    local: LocalAnswer | None = None  # where the answer was rated: the local answer before escalation
    trace: SpanContext | None = None  # the request's span: the shadow call's span is its child


def case_of(started: Any) -> ShadowCase | None:
    """The shadow case of a finished request, or None: for a tenant whose data must not leave the
    box (`allow_upstream: false`), and where a comparison would not be like for like: a request
    passed through whole (no token-level answer), more than one choice or prompt, an answer under a
    grammar (a direct call would not follow it), or one that did not finish (the client left, an
    error). `started` is admission's Admitted (or Passing), read by its fields: admission sits above
    this package."""
    decodings = getattr(started, "decodings", None)
    if not decodings or len(decodings) != 1 or not started.tenant.settings.allow_upstream:
        return None
    decoding = decodings[0]
    request = decoding.request
    if decoding.finish_reason is None or request.grammar is not None:
        return None
    return ShadowCase(
        alias=started.alias.name, tenant=started.tenant.id, tenant_rate=_tenant_rate(started.tenant),
        answer=decoding.text.text, routed_cost=decoding.usage.upstream_cost_usd, max_tokens=decoding.limit,
        messages=request.messages, prompt=request.prompt, continue_final=request.continue_final,
        temperature=request.sampling.temperature, top_p=request.sampling.top_p, seed=request.seed,
        extra=request.rules.upstream_params(), stop=request.stop, scope=decoding.gate.cache_scope,
        overrides=_overrides(started), local=_local(decoding), trace=request_trace())


def _local(decoding: Any) -> LocalAnswer | None:
    rated = decoding.rated
    if rated is None:
        return None
    stats, text = rated
    return LocalAnswer(stats, text, len(decoding.prompt_tokens), decoding.usage.agreement)


def _overrides(started: Any) -> tuple[dict[str, Any], ...]:
    tenant = getattr(started.tenant.settings, "routing", None)
    request = getattr(getattr(started, "body", None), "routing", None)
    return tuple(fields for fields in (set_fields(tenant), set_fields(request)) if fields)


def set_fields(override: Any) -> dict[str, Any]:
    """The fields a routing override (a tenant's or a request's `routing`, or None) sets."""
    return {} if override is None else override.model_dump(exclude_none=True)


def changes_routing(routing: Any, overrides: Sequence[Mapping[str, Any]]) -> bool:
    """Whether `overrides` (each the fields one override sets) change what an alias of `routing`
    runs: one sets a field to another value than the alias's, or sets the field its quality knob
    moves (the knob would no longer decide it, even at the same value). Such a request's shadow
    sample says nothing about the alias's own routing, so it never feeds the knob."""
    if not any(overrides):
        return False
    own = routing.model_dump(exclude_none=True)
    knob = routing.knob.field if routing.knob is not None else None
    return any(key == knob or own.get(key) != value for fields in overrides for key, value in fields.items())


def _tenant_rate(tenant: Any) -> float | None:
    override = getattr(tenant.settings, "shadow", None)
    return None if override is None else override.rate


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to its first stop string, as the routed answer was cut."""
    found = [index for index in (text.find(stop) for stop in stops if stop) if index >= 0]
    return text[:min(found)] if found else text
