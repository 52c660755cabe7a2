"""How far a batched sequence strays from what it would get alone, with flash attention on and off.

Run: .venv/bin/python -m bench.batch_drift [--model smollm2-135m-instruct] [--steps 24]

For each setting, eight prompts are decoded greedily one at a time in an engine of one sequence
(the reference) and four at a time in an engine of four, as served, loaded as the engine tests load
them (one thread, 1,024 tokens a sequence). Per step, up to the first
token where the two part, it prints the distribution of the mean |logit difference|, and for each
prompt that left the reference's greedy text, the reference's gap between its top token and the
one the batched sequence took (a near-tie when small). A fault (a wrong position, attention across
sequences) shows as mean differences of 3.8-5.6; rounding as under about 1.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

from adapters.model_files import resolve_model
from bench.support import greedy, load, prompt

SYSTEMS = ["You are a terse assistant who answers in French. " * 6, "You are a pirate. Speak like one, arr. " * 6,
           "Be brief.", "You are a helpful assistant."]
QUESTIONS = ["Bonjour?", "Ahoy?", "Name a colour.", "Count to ten.", "Tell me a tale.", "What is rain?",
             "Write a haiku about the sea.", "Explain gravity briefly."]


def compare(batched: tuple[list[int], list], alone: tuple[list[int], list]) -> tuple[list[float], float | None]:
    """Per-step mean |logit difference| up to the first divergence, and the reference's gap there."""
    steps = []
    for token, logits, expected, reference in zip(*batched, *alone):
        steps.append(float(np.mean(np.abs(logits - reference))))
        if token != expected:
            return steps, float(np.max(reference) - reference[token])
    return steps, None


async def drift(path, flash_attn: bool, steps: int) -> None:
    solo, batched = await load(path, parallel=1, flash_attn=flash_attn), await load(path, flash_attn=flash_attn)
    try:
        prompts = [prompt(solo, SYSTEMS[i % 4], question) for i, question in enumerate(QUESTIONS)]
        alone = [await greedy(solo, tokens, steps) for tokens in prompts]
        together = []
        for start in range(0, len(prompts), 4):
            together += await asyncio.gather(*(greedy(batched, t, steps) for t in prompts[start:start + 4]))
    finally:
        solo.close()
        batched.close()
    compared = [compare(b, a) for b, a in zip(together, alone)]
    differences = np.array([d for step_differences, _ in compared for d in step_differences])
    gaps = [round(gap, 3) for _, gap in compared if gap is not None]
    print(f"flash attention {'on ' if flash_attn else 'off'}: {len(differences)} steps, mean |logit difference| "
          f"median {np.median(differences):.3f}, p90 {np.quantile(differences, 0.9):.3f}, "
          f"max {differences.max():.3f}; {len(gaps)} of {len(prompts)} left the lone text, at gaps {gaps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    path = resolve_model(args.model)
    print(f"{args.model}: {len(QUESTIONS)} prompts, {args.steps} greedy steps, 4 batched against 1 alone, 1 thread")
    for flash_attn in (False, True):
        asyncio.run(drift(path, flash_attn, args.steps))


if __name__ == "__main__":
    main()
