"""The sampled answers an agreement check (policies/agreement.py) compares the greedy one with.

They decode beside the greedy answer, each on a sequence of its own in the local model's batched
engine (so `k` answers cost far less than `k` answers one after another), local only, at the
check's temperature, from the prompt tokens the greedy answer already holds. They start with the
answer and are awaited when it is rated, by a greedy answer that holds no sequence meanwhile (else
requests whose greedy answers held every sequence of the engine would wait forever for samples that
cannot get one); an answer that is never rated (the upstream finished it) stops them. A sample that
fails is left out of the agreement.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from gateway.decoding.answer import Answer
from gateway.decoding.signals import Sampling
from gateway.decoding.values import DecodeRequest, Piece
from policies.agreement import AgreementCheck

SEED_STRIDE = 7919  # sample i of a seeded request decodes with seed + i * this: apart from its choices' seeds


class SampleDecoding(Protocol):
    """A local-only decoding of the request's prompt (gateway.decoding.decoder.Decoding)."""

    answer: Answer

    def pieces(self) -> AsyncIterator[Piece]: ...


class AgreementSamples:
    """`check.samples - 1` local answers to `request`'s prompt, made by `decoding(request)`."""

    def __init__(self, request: DecodeRequest, check: AgreementCheck,
                 decoding: Callable[[DecodeRequest], SampleDecoding]) -> None:
        sampling, seed = Sampling(check.temperature, request.sampling.top_p), request.seed
        self._decodings = [decoding(request.local_sample(sampling, None if seed is None else seed + i * SEED_STRIDE))
                           for i in range(1, check.samples)]
        self._task: asyncio.Future | None = None

    def start(self) -> None:
        """Start decoding them (beside the greedy answer)."""
        self._task = asyncio.ensure_future(
            asyncio.gather(*(self._text(d) for d in self._decodings), return_exceptions=True))

    @property
    def finished(self) -> bool:
        """Whether every sample has finished (or failed)."""
        return self._task is not None and self._task.done()

    async def wait(self) -> None:
        """Until every sample has finished (or failed)."""
        await asyncio.wait([self._task])

    async def answers(self) -> list[tuple[str, Answer]]:
        """The text and answer of every sampled answer that did not fail, once all have finished."""
        return [(text, d.answer) for text, d in zip(await self._task, self._decodings) if isinstance(text, str)]

    @property
    def tokens(self) -> int:
        """Answer tokens the samples decoded (local: they cost no upstream tokens)."""
        return sum(len(d.answer.tokens) for d in self._decodings)

    async def end(self) -> None:
        """Stop samples still decoding (the answer was not rated, or its request ended)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @staticmethod
    async def _text(decoding: SampleDecoding) -> str:
        return "".join([piece.text async for piece in decoding.pieces()])
