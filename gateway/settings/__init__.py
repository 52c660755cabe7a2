"""The one settings tree: `config.yaml` plus `GATEWAY_*` environment overrides.

Nested keys are overridden with a double underscore, e.g. `GATEWAY_SERVER__PORT=9000` or
`GATEWAY_STORE__URL=redis://host:6379/0`. `load_settings` is the only place that reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PlainValidator, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

# The upstream branch of the tree is defined beside the upstream client (adapters import nothing
# from the gateway); it is loaded here with the rest.
from adapters.upstream_settings import LaunchSettings, UpstreamMode, UpstreamSettings  # noqa: F401
from gateway.presets import Preset, expanded
from gateway.settings.learning import LearnSettings, learn_problem
from gateway.settings.routing_values import AnswerReview, CeilingRule, CombineRule, HandoffRule, PolicyRule, rule_of
from gateway.settings.shadow import KnobSettings, OperatorShadowSettings, ShadowSettings, TenantShadow, quality_problem
from gateway.settings.tracing import TracingSettings
from policies.agreement import AgreementCheck, AnswerFormat, KeptAnswer
from policies.answer_check import AnswerCheck
from policies.registry import POLICIES


class SettingsError(Exception):
    """The configuration is unusable; the message is one line that names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(Strict):
    host: str = Field("127.0.0.1", description="Interface the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port of the HTTP server.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest accepted request body.")
    max_body_depth: int = Field(64, ge=8, le=512, description="Deepest nesting of lists and objects in a request body.")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Seconds a client may take to send a request's line and headers, counted from when "
        "its connection opens or its previous answer ends; then the connection is closed.")
    body_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a client may take to send a request's whole body; then a 408.")
    max_tool_schema_depth: int = Field(
        24, ge=2, le=256, description="Deepest nesting in one tool's (or function's) definition; deeper is a 400.")
    max_tool_schema_bytes: int = Field(65_536, ge=256, description="Largest JSON size of one tool's definition.")
    max_tokens_limit: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none.")
    queue_limit: int = Field(16, ge=0, description="Requests that may wait for the local model before 503.")
    drain_seconds: float = Field(30.0, ge=0, description="On SIGTERM, how long streams in flight may finish.")
    public_metrics: bool = Field(
        False, description="false: /metrics answers only the admin key (Prometheus: `authorization: {credentials: "
        "<admin key>}`); true: anyone who reaches the port may scrape it.")
    docs: bool = Field(
        False, description="Serve /openapi.json, the gateway's API description (it names every alias). No /docs page "
        "either way: it would load its scripts from a public CDN.")


class SteeringSettings(Strict):
    """A control vector added to the local model's residual stream (docs/steering.md)."""

    vector: str = Field(..., description="Steering vector file (python -m gateway steer fit), fitted for this "
                        "entry's GGUF: another model's, or one of another width, stops start-up.")
    scale: float = Field(..., allow_inf_nan=False, description="Multiplier of the file's directions: 1 adds the "
                         "fitted contrast once per steered layer; negative steers away from the concept.")
    layers: tuple[int, int] = Field(..., description="[first, last]: the layers (inclusive, counted from 0) whose "
                                    "output the vector is added to; llama.cpp steers no layer 0.")

    @field_validator("layers")
    @classmethod
    def _ordered(cls, layers: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= layers[0] <= layers[1]:
            raise ValueError("layers must be [first, last] with 1 <= first <= last")
        return layers


class LocalModelSettings(Strict):
    gguf: str = Field(..., description="Catalog name (see adapters/model_files.py) or a path to a GGUF file.")
    n_ctx: int = Field(4096, ge=256, description="Context length of the llama.cpp context.")
    n_threads: int = Field(2, ge=1, description="llama.cpp threads; keep at or below the free cores.")
    n_batch: int = Field(256, ge=16, description="Most tokens one engine step evaluates (decode steps plus prefill).")
    parallel: int = Field(
        4, ge=1, le=64, description="Requests the engine decodes at once (sequences in one KV cache of "
        "parallel x n_ctx cells); more wait in the queue.")
    look_ahead: bool = Field(
        True, description="While a greedy (temperature 0) request decides on a token, evaluate the local "
        "greedy token next; a guess that was not taken is dropped. Off: each step waits for its request.")
    flash_attn: bool = Field(
        True, description="llama.cpp's flash attention in the engine's context, as llama.cpp's own tools run on "
        "CPUs: one stream's steps 1.06-1.18x faster on SmolLM2 (most where a step is short). Its kernel rounds more "
        "coarsely, so batched sequences flip greedy near-ties against what each would get alone more often.")
    steering: SteeringSettings | None = Field(
        None, description="A control vector applied to this entry's own engine; an entry naming the same GGUF without "
        "it decodes unsteered beside it (docs/steering.md).")


ThresholdSource = Literal["router", "traffic"]
THRESHOLD_FROM_HELP = (
    "learned with target_fraction: where the score threshold comes from. router: the one the router file fitted "
    "for that share (on its fit rows' text); traffic: the share's quantile of the router's recent scores on this "
    "tenant's requests to this alias, so the share holds on traffic unlike the fit rows (mixed tasks, a new task).")


class AgreementSettings(Strict):
    """The agreement check (policies/agreement.py): the local model's greedy answer and `samples - 1`
    sampled ones decode together; the share of sampled answers that agree with the greedy one rates it."""

    kind: Literal["agreement"] = Field(..., description="agreement: rate an answer by its own samples' agreement.")
    samples: int = Field(4, ge=2, le=8, description="Answers decoded in all, the greedy one included.")
    temperature: float = Field(0.7, gt=0, le=2, description="Sampling temperature of the other answers.")
    format: AnswerFormat = Field("auto", description="How final answers are read and compared: auto, number, "
                                 "letter, code or text (see docs/routing.md, 'The agreement check').")
    answer: KeptAnswer = Field("greedy", description="The answer kept: greedy (the greedy answer, rated by "
                               "the samples that agree with it) or majority (the answer most of the others agree "
                               "with, the greedy one on a tie, rated the same way; a held answer that asks no "
                               "logprobs: a streamed one has been shown).")


class RoutingSettings(Strict):
    policy: PolicyName = Field("entropy", description="Routing policy (see docs/routing.md).")
    threshold: float | None = Field(
        None, description="entropy: nats (default 2.0); top1: probability; margin: p1-p2; learned: router score; "
        "first: how many answer tokens (no default).")
    target_fraction: float | None = Field(
        None, gt=0, le=1, description="Share of answer tokens to route upstream (target_fraction; learned: the "
        "share of steps it scores highest, by threshold_from).")
    threshold_from: ThresholdSource = Field("router", description=THRESHOLD_FROM_HELP)
    router: str | None = Field(
        None, description="Router file of the learned policy (python -m eval calibrate --learn), trained for this "
        "alias's local model; requests and tenants may choose policy learned only where the alias has one.")
    max_upstream_tokens: int | None = Field(None, ge=0, description="Cap on upstream answer tokens per request.")
    max_upstream_share: float | None = Field(None, ge=0, le=1, description="Cap on the upstream share of the answer.")
    span: int = Field(1, ge=1, le=64, description="Most tokens the upstream writes per hand-off.")
    span_until: SpanRule = Field(
        "tokens", description="Where a hand-off's text ends: tokens (all `span` tokens), or the end of the first "
        "word, line or sentence within them.")
    max_upstream_calls: int = Field(64, ge=0, description="Cap on upstream calls per request.")
    combine: Combine = Field(
        "take", description="How a routed step's token is chosen: take (the upstream's), contrastive (of the tokens "
        "the upstream finds plausible, the one maximising log p_upstream - combine_beta * log p_local) or fuse (the "
        "argmax of (1 - combine_weight) log p_local + combine_weight log p_upstream over both top lists); needs an "
        "upstream whose mode returns alternatives (tokens, completions, chat_continue).")
    combine_alpha: float = Field(0.1, gt=0, le=1, description="contrastive: a token is plausible at this share of "
                                 "the upstream's top probability or more.")
    combine_beta: float = Field(0.5, ge=0, le=10, description="contrastive: weight of the local model's log p.")
    combine_weight: float = Field(0.5, ge=0, le=1, description="fuse: weight of the upstream's log p.")
    combine_alternatives: int = Field(5, ge=1, le=20, description="contrastive and fuse: how many of its likeliest "
                                      "tokens a hand-off asks the upstream for (top_logprobs).")
    max_cost_ratio: float | None = Field(
        None, gt=0, le=1000, description="Cost ceiling: an answer's hand-offs never bill more than this multiple of "
        "what asking the upstream directly would cost (its price sheet: the prompt once, plus the answer's tokens).")
    on_ceiling: OnCeiling = Field(
        "local", description="When the next hand-off would pass the ceiling: local (finish locally) or escalate "
        "(the upstream writes the rest of the answer in one call).")
    answer_value: float | None = Field(
        None, gt=0, le=1000, description="Price-aware routing: what a correct answer is worth, in multiples of asking "
        "the upstream directly for it. A hand-off the policy wants is then made only if its chance of being needed "
        "times that value covers its predicted price (prices, prompt cache); null: decisions ignore price.")
    early_escalation: bool = Field(
        True, description="With answer_value: when the hand-offs the running rate predicts would cost at least the "
        "upstream writing the rest of the answer, hand the rest over in one call.")
    escalation: Escalation = Field(
        "continue", description="How an escalated answer (early_escalation, on_ceiling: escalate) that does not "
        "stream is finished: continue (the upstream writes the rest after the answer so far), afresh (the answer so "
        "far is thrown away and the upstream answers the prompt in one call, usage.routing.afresh), or draft (as "
        "afresh, and no hand-off is made before: the ones the policy wants are counted, usage.routing.draft_hand_offs, "
        "for early_escalation's running rate; needs answer_value, prices and no token or share cap). A streamed "
        "answer always continues: its text has been shown.")
    preset: Preset | None = Field(
        None, description="A named routing that measured best (gateway/presets.py, docs/routing.md 'Presets'): "
        "token-billed or self-hosted; the fields given beside it override its values.")
    answer_check: str | AgreementSettings | None = Field(
        None, description="Rates each finished answer (usage.routing.answer_confidence): an answer check file "
        "(python -m eval answer-check) fitted for this alias's local model, or {kind: agreement, ...}: the share of "
        "the local model's own sampled answers that agree with it, which needs no fitted file.")
    escalate_below: float | None = Field(
        None, ge=0, le=1, description="With answer_check: an answer that does not stream and is rated below this is "
        "thrown away and asked of the upstream afresh, in one call (usage.routing.afresh); null: never. An answer the "
        "upstream finished by escalating is not rated.")
    shadow: ShadowSettings | None = Field(None, description="Shadow answers: the upstream is also asked a sampled "
                                          "share of this alias's requests directly, to measure agreement and cost.")
    quality_target: float | None = Field(None, gt=0, lt=1, description="Agreement with upstream-only answers to "
                                         "hold (needs shadow and knob): the knob moves after each window of samples.")
    knob: KnobSettings | None = Field(None, description="The routing field a quality_target moves, and its bounds.")
    learn: LearnSettings | None = Field(None, description="Routing that learns on its own traffic: shadow samples "
                                        "become examples, an answer check is fitted on them and held to quality_target "
                                        "(docs/routing.md, 'Routing that learns'); `on` takes the defaults.")

    @model_validator(mode="after")
    def _quality_target(self) -> "RoutingSettings":
        learns = self.learn is not None and self.learn.enabled
        problem = quality_problem(self.shadow, self.quality_target, self.knob, learns) or \
            learn_problem(self.learn, self.shadow, self.quality_target)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="before")
    @classmethod
    def _policy_defaults(cls, data: Any) -> Any:
        data = expanded(data) if isinstance(data, dict) else data
        name = data.get("policy", "entropy") if isinstance(data, dict) else None
        entry = POLICIES.get(name) if isinstance(name, str) else None  # any other value is refused below
        if entry is None:
            return data
        return {**data, **{key: value for key, value in entry.defaults.items() if data.get(key) is None}}

    @model_validator(mode="after")
    def _policy_needs(self) -> "RoutingSettings":
        entry = POLICIES[self.policy]
        if any(all(getattr(self, key) is None for key in need.fields) for need in entry.needs):
            raise ValueError(f"policy '{self.policy}' needs {' and '.join(need.what for need in entry.needs)}")
        wrong = entry.check(vars(self)) if entry.check else None
        if wrong:
            raise ValueError(f"policy '{self.policy}' {wrong[1]}")
        if self.escalate_below and self.answer_check is None:
            raise ValueError("escalate_below needs an answer_check")
        problem = draft_problem(vars(self))  # the fields as they are: no copy per request
        if problem:
            raise ValueError(problem)
        return self

    # the rules the policy and the decoding read, each handed out whole (gateway/settings/routing_values.py)

    @property
    def policy_rule(self) -> PolicyRule:
        """What the policy reads beside its name: threshold, target, caps, price terms."""
        return rule_of(PolicyRule, self)

    @property
    def handoffs(self) -> HandoffRule:
        """How much one hand-off asks for: span and span_until."""
        return rule_of(HandoffRule, self)

    @property
    def combining(self) -> CombineRule:
        """How a routed step's token is chosen: combine and its parameters."""
        return rule_of(CombineRule, self)

    @property
    def ceiling(self) -> CeilingRule:
        """The cost ceiling: max_cost_ratio and on_ceiling."""
        return rule_of(CeilingRule, self)

    def review(self, fitted: AnswerCheck | None, held: bool) -> AnswerReview:
        """What may become of an answer before it is shown (`held`: the request does not stream): rated by
        the agreement check this routing asks for, else by the alias's `fitted` check file (None: none),
        and asked afresh below escalate_below (0 or null: never) or when it escalates."""
        agreement = self.answer_check
        check = AgreementCheck(agreement.samples, agreement.temperature, agreement.format, agreement.answer) \
            if isinstance(agreement, AgreementSettings) else fitted
        return rule_of(AnswerReview, self, answer_check=check, escalate_below=self.escalate_below or None, held=held)


def knob_reads(field: str, policy: str, checked: bool) -> bool:
    """Whether moving routing `field` changes what `policy` does (escalate_below: with an answer check)."""
    if field == "escalate_below":
        return checked
    return any(field in need.fields for need in POLICIES[policy].needs)


def draft_problem(routing: Mapping[str, Any], priced: bool = True) -> str | None:
    """Why a draft (`escalation: draft`) could never be asked afresh under these routing fields,
    for an upstream that is `priced` (None: it could, or nothing drafts). Only the price rule's
    early escalation ends a draft, and a token or share cap would cut the whole answer it asks for."""
    if routing["escalation"] != "draft":
        return None
    if routing["answer_value"] is None or not routing["early_escalation"]:
        return "escalation 'draft' needs answer_value with early_escalation"
    if routing["max_upstream_tokens"] is not None or (routing["max_upstream_share"] or 1.0) < 1:
        return "escalation 'draft' asks afresh for whole answers, which max_upstream_tokens and max_upstream_share cut"
    if not priced:
        return "escalation 'draft' needs an upstream with prices: a free one never escalates"
    return None


def _registered(name: Any) -> str:
    """`name` if a policy is registered under it (policies.registry), else refused as a Literal of
    the registered names would be (same error type and message)."""
    if isinstance(name, str) and name in POLICIES:
        return name
    names = [repr(known) for known in POLICIES]
    expected = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})


class _RegisteredNames:
    """JSON schema of a policy name: an enum of the names registered when the schema is made."""

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return {"enum": list(POLICIES), "type": "string"}


PolicyName = Annotated[str, PlainValidator(_registered), _RegisteredNames()]
OnCeiling = Literal["local", "escalate"]
Escalation = Literal["continue", "afresh", "draft"]
SpanRule = Literal["tokens", "word", "line", "sentence"]
Combine = Literal["take", "contrastive", "fuse"]


class RoutingOverride(Strict):
    """Routing fields a tenant's config or a request's `routing` object may override."""

    policy: PolicyName | None = Field(None, description="Routing policy.")
    threshold: float | None = Field(None, gt=-1e6, lt=1e6, description="The policy's threshold.")
    target_fraction: float | None = Field(None, gt=0, le=1, description="Share for target_fraction.")
    threshold_from: ThresholdSource | None = Field(None, description=THRESHOLD_FROM_HELP)
    max_upstream_tokens: int | None = Field(None, ge=0, description="Cap on upstream answer tokens per request.")
    max_upstream_share: float | None = Field(None, ge=0, le=1, description="Cap on the upstream share of the answer.")
    span: int | None = Field(None, ge=1, le=64, description="Most tokens the upstream writes per hand-off.")
    span_until: SpanRule | None = Field(None, description="Where a hand-off's text ends: tokens, word, line, sentence.")
    combine: Combine | None = Field(None, description="How a routed step's token is chosen: take, contrastive, fuse.")
    combine_alpha: float | None = Field(None, gt=0, le=1, description="contrastive: plausibility share of the "
                                        "upstream's top probability.")
    combine_beta: float | None = Field(None, ge=0, le=10, description="contrastive: weight of the local log p.")
    combine_weight: float | None = Field(None, ge=0, le=1, description="fuse: weight of the upstream's log p.")
    combine_alternatives: int | None = Field(None, ge=1, le=20, description="contrastive and fuse: the upstream's "
                                             "alternatives a hand-off asks for.")
    max_cost_ratio: float | None = Field(None, gt=0, le=1000, description="Cost ceiling, as a multiple of asking the "
                                         "upstream directly.")
    on_ceiling: OnCeiling | None = Field(None, description="At the ceiling: local or escalate.")
    answer_value: float | None = Field(None, gt=0, le=1000, description="Price-aware routing: a correct answer's "
                                       "worth, in multiples of asking the upstream directly.")
    early_escalation: bool | None = Field(None, description="With answer_value: escalate when the running rate of "
                                          "hand-offs predicts they would cost more than the upstream writing the rest.")
    escalation: Escalation | None = Field(None, description="How an escalated answer that does not stream is "
                                          "finished: continue (after the answer so far), afresh (asked anew) or draft "
                                          "(asked anew, no hand-off made before).")
    escalate_below: float | None = Field(None, ge=0, le=1, description="Ask the upstream afresh for an answer that "
                                         "does not stream and that the alias's answer check rates below this; 0: never.")
    answer_check: AgreementSettings | None = Field(None, description="The agreement check for this request (a fitted "
                                                   "check file is the configuration's to name, never a request's).")


Unsupported = Literal["upstream", "refuse"]
UNSUPPORTED_HELP = ("What happens to a request the local model cannot serve (tools, images, ...): upstream: it passes "
                    "through whole to the alias's upstream; refuse: 400 naming the field.")


class AliasSettings(Strict):
    local: str = Field(..., description="Key of models.local that decodes every token.")
    upstream: str | None = Field(None, description="Key of upstreams that takes uncertain steps (none: local only).")
    unsupported: Unsupported = Field("upstream", description=UNSUPPORTED_HELP)
    routing: RoutingSettings = Field(default_factory=RoutingSettings, description="Default routing of this alias.")


class ModelsSettings(Strict):
    local: dict[str, LocalModelSettings] = Field(..., description="Local llama.cpp models by key.")


class StoreSettings(Strict):
    backend: Literal["memory", "redis"] = Field("memory", description="memory: one process; redis: shared ledger.")
    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL (redis:// or rediss:// or unix://).")
    cluster: bool = Field(False, description="The URL names a node of a Redis Cluster (each tenant's keys share one "
                          "slot by their hash tag).")
    key_prefix: str = Field("rgw", description="Prefix of every Redis key.")
    timeout_s: float = Field(0.25, gt=0, description="Time-out of every Redis call.")
    reservation_ttl_s: float = Field(60.0, gt=0, description="A reservation left by a dead process expires after this.")
    cache_ttl_s: float = Field(86_400.0, gt=0, description="Lifetime of cached upstream continuations.")
    cache_max_entries: int = Field(10_000, ge=1, description="Most cached continuations kept (oldest dropped first).")
    responses_ttl_s: float = Field(30 * 86_400.0, gt=0, description="Lifetime of stored Responses API responses "
                                   "(`store: true`), after which `previous_response_id` cannot name them.")
    responses_max_entries: int = Field(10_000, ge=1, description="Most stored responses the memory backend keeps "
                                       "(oldest dropped first); Redis keeps each for its TTL.")
    responses_max_per_tenant: int = Field(
        10_000, ge=1, description="Most stored responses one tenant keeps at once. Past this (or "
        "responses_max_bytes_per_tenant) a `store: true` request is answered but not stored: its response says "
        "`store: false`.")
    responses_max_bytes_per_tenant: int = Field(
        100_000_000, ge=1024, description="Most bytes (UTF-8 JSON) of stored responses one tenant keeps at once.")
    max_memory_fraction: float = Field(
        0.8, gt=0, le=1, description="redis: above this share of Redis's maxmemory (INFO memory, read at most once a "
        "second) stored responses and cached continuations are not written, keeping room for budgets and rate "
        "limits; a Redis without maxmemory has no such guard.")
    memory_max_bytes: int = Field(
        256_000_000, ge=1024, description="memory: most bytes of stored responses and cached continuations together; "
        "past it neither is written.")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        parsed = urlparse(url)
        if parsed.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"not a Redis URL (scheme must be redis://, rediss:// or unix://): {url!r}")
        try:
            _ = parsed.port  # urllib raises ValueError for a port that is not a number in range
        except ValueError as exc:
            raise ValueError(f"bad port in Redis URL {url!r}") from exc
        return url


class BudgetSettings(Strict):
    upstream_tokens: int | None = Field(None, ge=0, description="Billed upstream prompt+completion tokens per window.")
    upstream_cost_usd: float | None = Field(None, ge=0, description="Upstream cost per window.")


class RateLimitSettings(Strict):
    requests_per_minute: int | None = Field(None, ge=1, description="Requests per minute.")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Prompt tokens plus max_tokens of the requests admitted per minute (as OpenAI counts).")
    max_parallel: int | None = Field(None, ge=1, description="Requests in flight at once.")


class TenantSettings(Strict):
    id: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Tenant id (appears in usage and keys).")
    api_key_sha256: str | None = Field(None, description="SHA-256 hex of the tenant's API key.")
    api_key_env: str | None = Field(None, description="Environment variable holding the API key.")
    aliases: list[str] | None = Field(None, description="Model aliases this tenant may use (none: all).")
    daily: BudgetSettings = Field(default_factory=BudgetSettings, description="Budget per UTC day.")
    monthly: BudgetSettings = Field(default_factory=BudgetSettings, description="Budget per UTC month.")
    rate_limits: RateLimitSettings = Field(default_factory=RateLimitSettings, description="Rate limits.")
    routing: RoutingOverride | None = Field(None, description="Routing override applied to every request.")
    allow_upstream: bool = Field(True, description="False: data never leaves the box.")
    unsupported: Unsupported | None = Field(None, description=UNSUPPORTED_HELP + " Overrides the alias's.")
    cache_scope: Literal["tenant", "shared"] = Field(
        "tenant", description="Caches this tenant's requests reuse (the continuation cache, the local model's cached "
        "prompt prefixes, an isolated upstream's prefix cache): tenant (its own only) or shared (also those of every "
        "tenant that says shared: they can tell what the others asked).")
    on_budget_exhausted: Literal["local", "refuse"] = Field(
        "local", description="local: keep answering from the local model; refuse: 429 insufficient_quota."
    )
    shadow: TenantShadow | None = Field(None, description="Shadow answers for this tenant: off (none of its "
                                        "requests) or {rate: r} (its own share); null: the alias's rate.")

    def may_use(self, alias: str) -> bool:
        """Whether this tenant may call `alias` (its `aliases`, or every alias)."""
        return self.aliases is None or alias in self.aliases

    @model_validator(mode="after")
    def _has_key(self, info: ValidationInfo) -> "TenantSettings":
        stored = (info.context or {}).get(STORED_TENANT)  # the Store's tenants have keys of their own
        if not (self.api_key_sha256 or self.api_key_env or stored):
            raise ValueError(f"tenant '{self.id}' needs api_key_sha256 or api_key_env")
        return self


STORED_TENANT = "stored_tenant"  # validation context: a tenant read from the Store, whose keys are issued there


class Settings(BaseSettings):
    """The whole configuration of one gateway process."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", env_nested_delimiter="__", extra="forbid")

    server: ServerSettings = Field(default_factory=ServerSettings, description="HTTP server.")
    models: ModelsSettings = Field(..., description="Local models.")
    upstreams: dict[str, UpstreamSettings] = Field(default_factory=dict, description="Upstream models by key.")
    aliases: dict[str, AliasSettings] = Field(..., description="Served model names (the request's `model`).")
    store: StoreSettings = Field(default_factory=StoreSettings, description="Usage ledger, budgets and caches.")
    tenants: list[TenantSettings] = Field(default_factory=list, description="Who may call the gateway.")
    admin_key_env: str = Field("GATEWAY_ADMIN_KEY", description="Environment variable holding the admin key.")
    shadow: OperatorShadowSettings = Field(default_factory=OperatorShadowSettings, description="Shadow answers' "
                                           "operator budget, queue and timeline (aliases' routing.shadow).")
    tracing: TracingSettings = Field(default_factory=TracingSettings, description="OpenTelemetry traces over "
                                     "OTLP/HTTP (off unless `otlp_endpoint` is set).")

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)  # the environment overrides config.yaml

    @model_validator(mode="after")
    def _references_exist(self) -> "Settings":
        for name, alias in self.aliases.items():
            if alias.local not in self.models.local:
                raise ValueError(f"aliases.{name}.local: no local model '{alias.local}'")
            if alias.upstream is not None and alias.upstream not in self.upstreams:
                raise ValueError(f"aliases.{name}.upstream: no upstream '{alias.upstream}'")
        return self

    @model_validator(mode="after")
    def _shadow_references(self) -> "Settings":
        for name, alias in self.aliases.items():
            routing = alias.routing
            if routing.shadow is not None and alias.upstream is None:
                raise ValueError(f"aliases.{name}.routing.shadow: the alias has no upstream to ask")
            knob = routing.knob
            if knob is not None and not knob_reads(knob.field, routing.policy, routing.answer_check is not None):
                unread = f"{knob.field} without an answer_check" if knob.field == "escalate_below" else knob.field
                raise ValueError(f"aliases.{name}.routing.knob.field: policy '{routing.policy}' does not read {unread}")
            if knob is not None and knob.quality_sign(routing.policy) is None:
                raise ValueError(f"aliases.{name}.routing.knob.more_quality: say whether raising or lowering "
                                 f"{knob.field} buys agreement under policy '{routing.policy}'")
        if any(tenant.id == self.shadow.operator for tenant in self.tenants):
            raise ValueError(f"shadow.operator: '{self.shadow.operator}' is a client tenant; shadow calls are "
                             "billed to an operator id of their own")
        return self


def load_settings(path: str | Path) -> Settings:
    """Read `path` (YAML) and the environment into Settings, or raise SettingsError (one line)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SettingsError(f"config file {path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(raw, dict):
        raise SettingsError(f"config file {path} must hold a mapping at the top level")
    try:
        return Settings(**raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise SettingsError(f"config {path}: {key}: {first['msg']}") from exc
