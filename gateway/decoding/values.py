"""The decoder's values: what a request asks (`DecodeRequest`, with its routing whole:
`RequestRouting`), what each step adds (`Piece`), what a hand-off wrote (`Written`), a guessed step
(`Guess`), and the request's accounting (`RoutingUsage`, returned as `usage.routing`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from adapters.slot_queue import Claim
from adapters.upstream import Alternatives, Continuation
from gateway.decoding.cost_ceiling import CostCeiling
from gateway.decoding.logit_rules import LogitRules
from gateway.decoding.signals import Sampling
from gateway.settings.routing_values import AnswerReview, CombineRule, HandoffRule
from policies import Decision, Policy, RecentValues, Signal, build_policy

LOCAL, UPSTREAM, CACHE = "local", "upstream", "cache"  # where an answer token came from
GUESS_LIMIT = 8  # most local tokens guessed ahead while a hand-off is in flight
# Most tokens one hand-off writes under a grammar: the upstream writes freely and the grammar cuts
# its text at the first break, so a longer span would mostly be generated (and billed) in vain.
GRAMMAR_SPAN = 16


class Written(NamedTuple):
    """What a hand-off wrote: `finished` if the upstream ended the answer there; `billed_tokens`,
    the completion tokens the upstream billed for exactly this text (None from the cache or once cut)."""

    text: str
    finished: bool
    source: str
    billed_tokens: int | None = None
    first: Alternatives | None = None  # with alternatives asked for: the first token's, see Continuation


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...]


@dataclass(frozen=True)
class Piece:
    """What one step added to the answer: the text now safe to show and where it came from."""

    text: str
    tokens: tuple[int, ...]
    source: str  # local | upstream | cache
    signal: Signal | None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class RequestRouting:
    """What a request lets the upstream do, and what may become of its answer before it is shown:
    its `policy`, how much a hand-off asks for (and how a routed step's token is chosen: `combine`),
    its cost ceiling (shared by the request's choices; None without an upstream), its answer's
    review, and the lengths of recent answers like it (the
    tenant's on the alias: this answer's length joins them, and a priced decision expects as much
    still to come as those longer than it wrote). The default is local only, reviewed by nothing."""

    policy: Policy = field(default_factory=lambda: build_policy("never"))
    handoffs: HandoffRule = HandoffRule()
    ceiling: CostCeiling | None = None
    review: AnswerReview = AnswerReview()
    answer_lengths: RecentValues | None = None
    combine: CombineRule = CombineRule()

    @property
    def capped_cost(self) -> bool:
        """A cost ceiling is set (not only the report): every hand-off is held against it first."""
        return self.ceiling is not None and self.ceiling.ratio is not None

    @property
    def escalates_past_ceiling(self) -> bool:
        """Past the cost ceiling the upstream writes the rest of the answer (on_ceiling: escalate)."""
        return self.ceiling is not None and self.ceiling.escalates


@dataclass(frozen=True)
class DecodeRequest:
    """What one answer asks: its prompt (`messages`, or the raw text `prompt`), limits, sampling and
    logit rules, and its `routing`: the whole of what the upstream may do for it."""

    messages: list[dict[str, Any]]  # the chat to answer (unless `prompt` is set)
    max_tokens: int
    routing: RequestRouting = field(default_factory=RequestRouting)
    sampling: Sampling = Sampling()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    continue_final: bool = False
    logprobs: int | None = None  # None: none; k: each answer token's logprob, with its k likeliest alternatives
    guess_ahead: int = GUESS_LIMIT  # 0: wait idle during hand-offs
    rules: LogitRules = LogitRules()
    grammar: str | None = None  # GBNF the answer must follow
    prompt: str | None = None  # raw text to continue instead of `messages` (legacy completions), as plain text
    choice: int = 0
    claim: Claim | None = None  # whose request it is, for the engine's fair share (shared by its choices and samples)

    def local_sample(self, sampling: Sampling, seed: int | None) -> DecodeRequest:
        """This prompt, within the same limits, decoded locally at `sampling` and shown to nobody (an
        agreement check's sampled answer): its routing is local only, and it returns no logprobs."""
        return dataclasses.replace(self, routing=RequestRouting(), sampling=sampling, seed=seed, logprobs=None)


@dataclass(frozen=True)
class Guess:
    """A greedy local token decoded while a hand-off was in flight, with what the step saw."""

    token: int
    logits: np.ndarray
    signal: Signal
    decision: Decision | None = None  # once the policy routed the step


@dataclass
class RoutingUsage:
    """Per-request accounting, as returned in `usage.routing`."""

    policy: str
    guess_kept_tokens: int = 0  # local tokens decoded during hand-offs and kept
    # hand-offs whose guess was thrown away whole: the upstream wrote something else first, or the answer ended
    guesses_dropped: int = 0
    upstream_calls: int = 0  # hand-offs answered by the upstream (a warm-up is billed but not counted here)
    upstream_prompt_tokens: int = 0
    upstream_completion_tokens: int = 0
    upstream_cached_tokens: int = 0  # of the prompt tokens, those the upstream read from its cache
    upstream_compute_ms: float = 0.0  # the upstream's own prompt + generation time, where it reports it
    upstream_cost_usd: float = 0.0
    escalated: bool = False  # the upstream was asked for the rest of the answer in one call
    afresh: bool = False  # ... for the whole answer, the local one thrown away (its tokens: discarded_tokens)
    discarded_tokens: int = 0
    answer_confidence: float | None = None  # the answer check's rating of the local answer
    samples: int | None = None  # with the agreement check: answers decoded in all, the greedy one included
    agreement: float | None = None  # ... the share of the sampled ones that agree with the answer kept
    majority: bool = False  # ... a sampled answer was kept: the majority's, not the greedy one
    sample_tokens: int = 0  # ... the local tokens the sampled answers took
    price_vetoes: int = 0  # steps the policy wanted upstream that were not worth their predicted price
    draft_hand_offs: int = 0  # under escalation: draft, hand-offs the policy wanted, counted and not made
    predicted_cost_usd: float = 0.0  # what the calls made were expected to bill (prices and prefix reuse)
    # routed steps' tokens by how they were chosen (policies/combine.py): taken (combine: take, or a
    # hand-off that was escalated), agreed (the rule chose the upstream's token), changed (another one),
    # fell_back (no alternatives or no alignment with the local vocabulary: the upstream's taken)
    combined: dict[str, int] = field(default_factory=dict)
    degraded: list[str] = field(default_factory=list)

    def count_combined(self, how: str) -> None:
        self.combined[how] = self.combined.get(how, 0) + 1

    def degrade(self, reason: str) -> None:
        if reason not in self.degraded:
            self.degraded.append(reason)

    def bill(self, continuation: Continuation, warm: bool = False) -> None:
        if not warm:
            self.upstream_calls += 1
        self.upstream_prompt_tokens += continuation.prompt_tokens
        self.upstream_completion_tokens += continuation.completion_tokens
        self.upstream_cached_tokens += continuation.cached_tokens
        self.upstream_compute_ms += continuation.compute_ms or 0.0
        self.upstream_cost_usd += continuation.cost_usd
