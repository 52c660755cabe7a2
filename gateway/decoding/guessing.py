"""Guessing during hand-offs. While a greedy request's hand-off is in flight, the local model goes on
decoding its own greedy guess; if the upstream writes what the guess began with, the rest of the
guess is kept (the decoder passes each kept step to the policy, as it would have in turn, and hands
off the first it routes as decided, with no second forward or decision), otherwise it is dropped
and the next forward rewinds the sequence. A guessed step that would end after the reply is due is
not begun: a step cannot be stopped, and the answer would wait for it. Off under a grammar.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import numpy as np

from adapters.engine import Sequence
from gateway.decoding.answer import Answer
from gateway.decoding.handoffs import HandoffCalls
from gateway.decoding.local_steps import LocalSteps
from gateway.decoding.values import DecodeRequest, Guess, RoutingUsage
from policies import Signal


class StepClock(Protocol):
    """The local model's end token test and its recent step time (adapters.local_model.LocalModel)."""

    @property
    def step_s(self) -> float | None: ...

    def is_end_of_generation(self, token: int) -> bool: ...


class Guessing:
    """One request's guesses while its hand-offs are in flight (greedy only, and none under a
    grammar); dropped ones are counted in `usage`."""

    def __init__(self, request: DecodeRequest, local: StepClock, steps: LocalSteps, calls: HandoffCalls,
                 usage: RoutingUsage, answer: Answer) -> None:
        self._local, self._steps, self._calls, self._usage, self._answer = local, steps, calls, usage, answer
        self._ahead = request.guess_ahead
        self._on = request.sampling.greedy and request.guess_ahead > 0 and not answer.constrained

    async def guess(self, sequence: Sequence, logits: np.ndarray, signal: Signal, call: asyncio.Future,
                    sent: float) -> list[Guess]:
        """Greedy local tokens from this step on (its `logits` and `signal`), decoded until the hand-off
        `call` (sent at `sent`) is done, or is due before one more step could end; the sequence is then
        paused until the hand-off returns: the engine must not wait for this request."""
        guesses = [Guess(int(np.argmax(logits)), logits, signal)] if self._on else []
        while guesses and not call.done() and len(guesses) <= self._ahead:
            answer = self._answer.tokens
            if self._local.is_end_of_generation(guesses[-1].token) or len(answer) + len(guesses) >= self._answer.limit:
                break
            if self._reply_due_within(self._local.step_s, sent):
                break
            ahead = await self._steps.forward(sequence, answer + [g.token for g in guesses])
            position = len(answer) + len(guesses)
            guesses.append(Guess(int(np.argmax(ahead)), ahead, self._steps.signal(ahead, position)))
        sequence.pause()
        return guesses

    def kept(self, before: list[int], guesses: list[Guess]) -> list[Guess]:
        """The guessed steps after what the hand-off wrote (the answer was `before`), if it wrote what
        the guess began with and the answer goes on; none else (a dropped guess is counted)."""
        answer = self._answer.tokens
        written = answer[len(before):]
        guessed = [g.token for g in guesses]
        if self._answer.finish_reason is not None or answer[:len(before)] != before or \
                not written or guessed[:len(written)] != written:
            self._usage.guesses_dropped += bool(guesses)
            return []
        return guesses[len(written):]

    def _reply_due_within(self, step_s: float | None, sent: float) -> bool:
        """Would a call sent at `sent` answer before a step of `step_s` started now ends, going by
        this request's last call? (Unknown before the first: no.)"""
        if step_s is None or self._calls.reply_s is None:
            return False
        return time.monotonic() + step_s > sent + self._calls.reply_s
