"""The decoder's values: what a request asks (`DecodeRequest`), what each step adds (`Piece`), what
a hand-off wrote (`Written`), a guessed step (`Guess`), and the request's accounting
(`RoutingUsage`, returned as `usage.routing`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from adapters.slot_queue import Claim
from adapters.upstream import Continuation
from gateway.decoding.cost_ceiling import CostCeiling
from gateway.decoding.logit_rules import LogitRules
from gateway.decoding.signals import Sampling
from policies import Decision, Policy, RecentValues, Signal
from policies.agreement import AgreementCheck
from policies.answer_check import AnswerCheck

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
class DecodeRequest:
    messages: list[dict[str, Any]]  # the chat to answer (unless `prompt` is set)
    max_tokens: int
    policy: Policy
    sampling: Sampling = Sampling()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    span: int = 1
    span_until: str = "tokens"  # word | line | sentence: keep a hand-off's text up to that boundary
    continue_final: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    guess_ahead: int = GUESS_LIMIT  # 0: wait idle during hand-offs
    rules: LogitRules = LogitRules()
    grammar: str | None = None  # GBNF the answer must follow
    prompt: str | None = None  # raw text to continue instead of `messages` (legacy completions), as plain text
    ceiling: CostCeiling | None = None  # shared by the request's choices; None without an upstream
    on_ceiling: str = "local"  # local | escalate: what a hand-off past the ceiling becomes
    escalation: str = "continue"  # continue | afresh | draft: how an escalated held answer is finished
    choice: int = 0
    answer_check: AnswerCheck | AgreementCheck | None = None  # rates the finished answer (usage.routing.answer_confidence)
    escalate_below: float | None = None  # a held answer rated below this is asked afresh
    held: bool = False  # nothing is shown before the answer is complete (the request does not stream)
    # the lengths of recent answers like this one (the tenant's on the alias): this answer's length
    # joins them, and a priced decision expects as much still to come as those longer than it wrote
    answer_lengths: RecentValues | None = None
    claim: Claim | None = None  # whose request it is, for the engine's fair share (shared by its choices and samples)

    @property
    def capped_cost(self) -> bool:
        """A cost ceiling is set (not only the report): every hand-off is held against it first."""
        return self.ceiling is not None and self.ceiling.ratio is not None


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
    degraded: list[str] = field(default_factory=list)

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
