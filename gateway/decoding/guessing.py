"""Guessing during hand-offs (mixed into Decoding). While a greedy request's hand-off is in flight,
the local model goes on decoding its own greedy guess; if the upstream writes what the guess began
with, the rest of the guess is kept (each kept step still passes the policy, as it would have in
turn, and the first it routes is handed off as decided, with no second forward or decision),
otherwise it is dropped and the next forward rewinds the sequence. A guessed step that would end
after the reply is due is not begun: a step cannot be stopped, and the answer would wait for it.
Off under a grammar.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from adapters.engine import Sequence
from gateway.decoding.values import Guess, Piece
from policies import Signal


class Guessing:
    """Decoding's guessing steps; they read and write its answer state."""

    async def _guess(self, sequence: Sequence, logits: np.ndarray, signal: Signal, call: asyncio.Future,
                     sent: float) -> list[Guess]:
        """Greedy local tokens from this step on, decoded until the hand-off `call` (sent at `sent`)
        is done, or is due before one more step could end: a step cannot be stopped, and the answer
        would wait for it."""
        guessing = self.request.sampling.greedy and self.request.guess_ahead > 0 and self._grammar is None
        guesses = [Guess(int(np.argmax(logits)), logits, signal)] if guessing else []
        while guesses and not call.done() and len(guesses) <= self.request.guess_ahead:
            if self.local.is_end_of_generation(guesses[-1].token) or len(self.answer_tokens) + len(guesses) >= self.limit:
                break
            if self._reply_due_within(self.local.step_s, sent):
                break
            ahead = await self._forward(sequence, self.answer_tokens + [g.token for g in guesses])
            position = len(self.answer_tokens) + len(guesses)
            guesses.append(Guess(int(np.argmax(ahead)), ahead, self._signal(ahead, position)))
        sequence.pause()  # until the hand-off returns: the engine must not wait for this request
        return guesses

    def _reply_due_within(self, step_s: float | None, sent: float) -> bool:
        """Would a call sent at `sent` answer before a step of `step_s` started now ends, going by
        this request's last call? (Unknown before the first: no.)"""
        if step_s is None or self.calls.reply_s is None:
            return False
        return time.monotonic() + step_s > sent + self.calls.reply_s

    def _keep_guesses(self, before: list[int], guesses: list[Guess]) -> list[Piece]:
        """The guessed steps after what the hand-off wrote, if it wrote what the guess began with."""
        written = self.answer_tokens[len(before):]
        guessed = [g.token for g in guesses]
        if self.finish_reason is not None or self.answer_tokens[:len(before)] != before or \
                not written or guessed[:len(written)] != written:
            self.usage.guesses_dropped += bool(guesses)
            return []
        pieces, answered = [], len(self.answer_tokens)
        for guess in guesses[len(written):]:
            if self.finish_reason is not None:
                break
            decision = self._decide(guess.signal)
            if decision.upstream:
                self._routed_guess = dataclasses.replace(guess, decision=decision)
                break
            pieces.append(self._accept(guess.token, guess.logits, guess.signal))
        self.usage.guess_kept_tokens += len(self.answer_tokens) - answered
        return pieces
