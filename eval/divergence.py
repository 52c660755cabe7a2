"""R2R's "divergent" label: a mismatch that changes the answer's outcome.

For each position where the local model's greedy token differs from the upstream's (the FS-GEN
mismatches), the local model continues the upstream's answer prefix twice, greedily: once after
its own token and once after the upstream's. The position is divergent when the two finished
answers extract to different predictions (fitting/answers.py); a mismatch that only rewords the
explanation is not. A router trained on these labels spends its hand-offs where they change
what the user gets. Roll-outs run together in the local model's batched engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from adapters.local_model import LocalModel
from fitting.answers import score
from fitting.datasets import Item


async def greedy(local: LocalModel, tokens: list[int], limit: int) -> list[int]:
    """The local model's greedy continuation of `tokens`, at most `limit` tokens."""
    out: list[int] = []
    async with local.sequence(tokens) as sequence:
        while len(out) < limit:
            token = int(np.argmax(await sequence.forward(tokens + out)))
            if local.is_end_of_generation(token):
                break
            out.append(token)
    return out


async def local_choices(local: LocalModel, prompt: list[int], reference: list[int], positions: list[int]) -> list[int]:
    """The local greedy token at each of `positions` along the upstream's answer `reference`."""
    choices = []
    async with local.sequence(prompt) as sequence:
        for p in positions:
            choices.append(int(np.argmax(await sequence.forward(prompt + reference[:p]))))
    return choices


async def divergent(local: LocalModel, dataset: str, item: Item, reference: list[int], mismatch: str,
                    max_tokens: int) -> str:
    """One character per answer position: 1 where the mismatch there changes the prediction."""
    prompt = local.tokenize_prompt(local.template.render_parts(item.messages))
    positions = [p for p, flag in enumerate(mismatch) if flag == "1"]
    mine = await local_choices(local, prompt, reference, positions)

    def text(tokens: list[int]) -> str:
        return b"".join(local.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    async def outcome(answer: list[int]) -> Any:
        if local.is_end_of_generation(answer[-1]):
            return score(dataset, item, text(answer[:-1])).pred
        rest = await greedy(local, prompt + answer, max(0, max_tokens - len(answer)))
        return score(dataset, item, text(answer + rest)).pred

    labels = ["0"] * len(mismatch)
    outcomes = await asyncio.gather(*(
        asyncio.gather(outcome(reference[:p] + [token]), outcome(reference[:p + 1]))
        for p, token in zip(positions, mine)))
    for p, (own, theirs) in zip(positions, outcomes):
        labels[p] = "1" if own != theirs else "0"
    return "".join(labels)
