"""What becomes of an answer's pieces before they are shown: held back, rated, perhaps replaced.

A held answer (the request does not stream) with an answer check, or one that may be asked afresh,
is shown once it is finished. The check (policies/answer_check.py, or the agreement check,
policies/agreement.py, with its samples decoding beside the answer) rates the finished answer's
chance of being correct (`usage.answer_confidence`); a held answer rated below `escalate_below` is
asked of the upstream afresh (gateway/decoding/escalation.py), and if that call fails the local
answer stands. A check fitted on answers' first K tokens (`at_tokens`) rates the answer as soon as it
has them, so one asked afresh is not finished locally first. An agreement check may keep the
majority's sampled answer in place of the greedy one, which nobody has seen. An answer the
upstream finished by escalating is neither rated nor asked afresh again.
"""

from __future__ import annotations

from typing import Any

from adapters.upstream import Continuations
from gateway.decoding.agreement_samples import AgreementSamples
from gateway.decoding.answer import Answer
from gateway.decoding.handoffs import HandoffCalls
from gateway.decoding.values import LOCAL, DecodeRequest, Piece, RoutingUsage
from policies import Signal
from policies.agreement import AgreementCheck
from policies.answer_check import AnswerStats
from policies.online_check import AnswerInputs


class Review:
    """One answer's pieces on their way out, and its rating (in `usage`); `held`: shown only once
    finished (and rated). `samples`: an agreement check's, None for any other check. `prompt_tokens`:
    the prompt's length, which a learned check reads."""

    def __init__(self, request: DecodeRequest, upstream: Continuations | None, calls: HandoffCalls,
                 usage: RoutingUsage, answer: Answer, samples: AgreementSamples | None, held: bool,
                 prompt_tokens: int) -> None:
        self._request, self._upstream, self._calls, self._usage = request, upstream, calls, usage
        self._answer, self._samples, self._prompt_tokens = answer, samples, prompt_tokens
        self._check = request.routing.review.answer_check
        self._held: list[Piece] | None = [] if held else None
        self._signals: list[Signal] = []  # what the check rates
        self.rated: tuple[AnswerStats, str] | None = None  # the answer as rated, before escalation (shadow)

    def shown(self, pieces: list[Piece]) -> list[Piece]:
        """The pieces to show now of a step's `pieces` (none while the answer is held)."""
        if self._check is not None:
            self._signals += [piece.signal for piece in pieces if piece.signal is not None]
        if self._held is None:
            return pieces
        self._held += pieces
        return []

    def restart(self) -> None:
        """The answer was replaced: nothing of the old one is shown or rated."""
        self._held, self._signals = [], []

    def replace(self, pieces: list[Piece]) -> None:
        """Hold `pieces` (a fresh answer's) in place of the answer's."""
        self._held = pieces

    def release(self) -> list[Piece]:
        """The held pieces, once the answer is finished and rated."""
        return self._held or []

    @property
    def due(self) -> bool:
        """Whether an unfinished answer has reached the tokens its check rates."""
        check, usage = self._check, self._usage
        return (check is not None and check.at_tokens is not None and usage.answer_confidence is None
                and not usage.escalated and len(self._answer.tokens) >= check.at_tokens)

    @property
    def rates_now(self) -> bool:
        """Whether to rate the answer where decoding stopped: it has a check and is unrated, its end is
        not the upstream's, and its samples (if any) are in (else the decoder waits for them holding
        no sequence: they may need its slot)."""
        if self._check is None or self._usage.answer_confidence is not None or self._upstream_finished:
            return False
        return self._samples is None or self._samples.finished

    @property
    def awaits_samples(self) -> bool:
        """Whether the answer is to be rated once its samples are in."""
        return self._samples is not None and not self._samples.finished and self._usage.answer_confidence is None

    @property
    def first_signal(self) -> Signal | None:
        """The signal of the answer's first step (the fresh answer's pieces carry it)."""
        return self._signals[0] if self._signals else None

    async def rate(self) -> bool:
        """Rate the finished answer (an agreement check may keep a sampled answer in its place);
        whether to ask the upstream afresh: the answer is held, rated below the bar, and the upstream
        may be asked."""
        check, usage = self._check, self._usage
        stats = AnswerStats.of(self._signals, len(self._answer.tokens), self._answer.finish_reason)
        agreement = isinstance(check, AgreementCheck)
        confidence = await self._agreement(check) if agreement else self._confidence(check, stats)
        self.rated = (stats, bytes(self._answer.data).decode("utf-8", "replace"))
        usage.answer_confidence = round(confidence, 4)
        below = self._request.routing.review.escalate_below
        if self._held is None or below is None or confidence >= below or self._calls.closed:
            return False
        if not self._upstream.available:
            usage.degrade("upstream_unavailable")
            return False
        return True

    def _confidence(self, check: Any, stats: AnswerStats) -> float:
        """A fitted file's check reads the answer's stats; a learned one (it `reads_inputs`:
        gateway/shadow/learning.py) also its format, the prompt's length and any agreement share."""
        if not getattr(check, "reads_inputs", False):
            return check.confidence(stats)
        text = bytes(self._answer.data).decode("utf-8", "replace")
        return check.confidence(AnswerInputs.of(stats, text, self._prompt_tokens, self._usage.agreement))

    async def _agreement(self, check: AgreementCheck) -> float:
        """The share of the samples that agree with the answer kept: the greedy one, or the majority's
        sampled one (held, without logprobs: the samples' tokens carry none), which takes its place."""
        sampled = await self._samples.answers()
        replaceable = self._held is not None and self._request.logprobs is None
        index, confidence = check.kept(bytes(self._answer.data).decode("utf-8", "replace"),
                                       [text for text, _ in sampled], replaceable)
        if index:
            self._usage.majority = True
            text = self._answer.adopt(sampled[index - 1][1])
            self._held = [Piece(text, tuple(self._answer.tokens), LOCAL, None)]
        self._usage.samples, self._usage.agreement = check.samples, round(confidence, 4)
        self._usage.sample_tokens = self._samples.tokens
        return confidence

    @property
    def _upstream_finished(self) -> bool:
        """The upstream wrote the answer's end in an escalation (or the whole answer afresh)."""
        return self._usage.escalated and bool(self._answer.sources) and self._answer.sources[-1] != LOCAL
