"""The oracle router: hand a step upstream exactly when the local greedy token is wrong.

"Wrong" means it differs from the upstream's greedy next token. We take the upstream's tokens
from its own greedy answer (the `upstream` config's record of the same item) instead of asking
the upstream at every step: under greedy decoding the oracle keeps the answer equal to the
upstream's answer (a matching local token is the upstream's token, a differing one is replaced by
the upstream's), so at step i the prefix is the reference's first i tokens and the upstream's
next token is reference[i]. Asking at every step would cost a probe call per token only to learn
what the reference already says, and the decoder would count the probes as routed tokens.

The local model's greedy tokens along the reference come from teacher-forcing it through the same
`LocalModel.forward` the decoder uses, one token at a time, so the numerics match the decode.

The upstream's numerics do not repeat exactly: a server that evaluates a batch of new prompt
tokens rounds differently from one that generated them one by one, so a routed call sometimes
picks the other side of a near-tie (measured on CSQA: about a third of the answers, after the
answer letter). The decoded prefix then leaves the reference and the mask no longer applies. We
re-anchor instead of giving up: ask the upstream for its greedy continuation of the prefix as it
now is (one call, outside the decoder's accounting, since it is the oracle's knowledge and not a
routed token), teacher-force the local model on it in one pass, and go on with the new mask. The
record counts re-anchors; after MAX_REANCHORS every remaining step goes upstream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from adapters.local_model import LocalModel
from adapters.upstream import Upstream
from fitting.analysis import TeacherForcer
from fitting.datasets import Item
from policies import LOCAL, UPSTREAM, Decision, RoutingState, Signal
from policies.base import PolicyDefaults

MAX_REANCHORS = 8
Reanchor = Callable[[list[int]], tuple[list[int], list[bool]]]


@dataclass
class Oracle(PolicyDefaults):
    """A policy for one item: route where `mismatch[position]` is true."""

    reference: list[int]
    mismatch: list[bool]
    answer: Callable[[], list[int]] = list
    reanchor: Reanchor | None = None
    name: str = "oracle"
    reanchors: int = 0
    first_divergence: int | None = None
    gave_up_at: int | None = None
    knowledge_s: float = field(default=0.0, repr=False)  # time spent re-anchoring, not routing

    def __post_init__(self) -> None:
        self._first = (len(self.reference), int(sum(self.mismatch)))

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        position = signal.position
        current = self.answer()
        if self.gave_up_at is None and current != self.reference[:position]:
            self._follow(current, position)
        if self.gave_up_at is not None or position >= len(self.mismatch):
            return UPSTREAM
        return UPSTREAM if self.mismatch[position] else LOCAL

    def _follow(self, current: list[int], position: int) -> None:
        if self.first_divergence is None:
            self.first_divergence = position
        if self.reanchor is None or self.reanchors >= MAX_REANCHORS:
            self.gave_up_at = position
            return
        started = time.monotonic()
        self.reference, self.mismatch = self.reanchor(list(current))
        self.reanchors += 1
        self.knowledge_s += time.monotonic() - started

    def summary(self) -> dict[str, int | None]:
        """The first reference's length and mismatches, and how often the decode left it."""
        return {"reference_tokens": self._first[0], "mismatches": self._first[1],
                "first_divergence": self.first_divergence, "reanchors": self.reanchors,
                "gave_up_at": self.gave_up_at}


async def local_mismatches(local: LocalModel, prompt: list[int], reference: list[int], ended: bool) -> list[bool]:
    """Teacher-force `local` on `reference`: at each position, does its greedy token differ?

    With `ended` (the reference stopped on its own) one more position says whether the local
    model would have gone on instead of stopping there.
    """
    mismatch = []
    async with local.sequence(prompt) as sequence:
        for index in range(len(reference) + (1 if ended else 0)):
            greedy = int(np.argmax(await sequence.forward(prompt + reference[:index])))
            if index < len(reference):
                mismatch.append(greedy != reference[index])
            else:
                mismatch.append(not local.is_end_of_generation(greedy))
    return mismatch


def reanchorer(local: LocalModel, upstream: Upstream, forcer: TeacherForcer, item: Item, max_tokens: int) -> Reanchor:
    """A function: decoded prefix -> (prefix + the upstream's greedy continuation, new mismatch mask).

    Blocking on purpose: it runs inside `decide`, between two decoder steps of the only request.
    """
    def reanchor(prefix: list[int]) -> tuple[list[int], list[bool]]:
        data = b"".join(local.token_bytes(t) for t in prefix)
        text, ended = _greedy_continuation(upstream, item, data.decode("utf-8", "replace"), max_tokens - len(prefix))
        reference = prefix + local.tokenize_text(text.encode("utf-8"))
        row = forcer.analyze(item, reference)
        mismatch = [False] * len(prefix) + [flag == "1" for flag in row["mismatch"][len(prefix):]]
        if ended:
            mismatch.append(not local.is_end_of_generation(row["next"]))
        return reference, mismatch

    return reanchor


def _greedy_continuation(upstream: Upstream, item: Item, answer: str, max_tokens: int) -> tuple[str, bool]:
    """The upstream's greedy continuation of `answer`, straight from its /v1/completions."""
    if max_tokens <= 0:
        return "", False
    prompt = upstream.with_answer(upstream.handoff(item.messages), answer).text
    body = {"prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, **upstream.settings.extra_body}
    response = httpx.post(f"{upstream.settings.api_base}/completions", json=body, timeout=upstream.settings.timeout_s)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["text"], choice.get("finish_reason") == "stop"
