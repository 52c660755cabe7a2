"""What the local model's hidden state costs per decode step, and what an MLP router's decision costs.

Run: .venv/bin/python -m bench.hidden_state [--model qwen2.5-coder-0.5b-instruct] [--steps 64]

Two groups of 1 (then 4) sequences decode the same prompts greedily, taking steps in turn: a step
of the group that does not ask for hidden states, then a step of the group that does, and so on
(the engine waits briefly for the group that does not come, then steps without it). Each engine step is
timed on the engine thread (llama_decode, the logits and hidden-state copies, and here a switch of
the context's embeddings output at every step, which live traffic makes only when the mix of
sequences changes). Adjacent steps see the same machine load, so the overhead is the median of
their paired differences, as a share of the median step without (target < 2%). Then the time of
one MLP router decision (features, one hidden layer, sigmoid, over the model's hidden state) as a
share of a one-sequence step (target < 1%).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import numpy as np

from adapters.engine import Engine
from adapters.local_model import LocalModel
from adapters.model_files import resolve_model
from gateway.decoding.signals import signal_of
from policies.learned import FEATURES
from policies.mlp_router import MlpRouter

QUESTIONS = ["Write a long story about a lighthouse keeper and a storm.",
             "Explain how a steam engine works, step by step.",
             "List the planets of the solar system and describe each one.",
             "Describe a day in the life of a medieval baker."]
STEPS: list[tuple[bool, float]] = []  # (some job asked for hidden states, engine-thread seconds) per step


def record_steps() -> None:
    """Time every Engine._step (the engine thread's work for one step) into STEPS."""
    step = Engine._step

    def timed(self, jobs):
        started = time.perf_counter()
        try:
            return step(self, jobs)
        finally:
            STEPS.append((any(job.hidden for job in jobs), time.perf_counter() - started))

    Engine._step = timed


async def paired_steps(local: LocalModel, count: int, steps: int) -> tuple[list[float], list[float]]:
    """Engine-thread seconds of `steps` decode steps of `count` sequences without hidden states
    and of as many with, taken in turn; the i-th of each are adjacent."""
    prompts = [local.tokenize_prompt(local.template.render_parts([{"role": "user", "content": q}]))
               for q in QUESTIONS[:count]]
    async with contextlib.AsyncExitStack() as stack:
        plain = [await stack.enter_async_context(local.sequence(p)) for p in prompts]
        hidden = [await stack.enter_async_context(local.sequence(p, hidden=True)) for p in prompts]
        tokens = {id(s): list(p) for s, p in zip(plain + hidden, prompts + prompts)}

        async def step(sequences) -> None:
            logits = await asyncio.gather(*(s.forward(tokens[id(s)]) for s in sequences))
            for s, row in zip(sequences, logits):
                tokens[id(s)] = tokens[id(s)] + [int(np.argmax(row))]

        await step(plain)  # prefill, not counted
        await step(hidden)
        STEPS.clear()
        for _ in range(steps):
            await step(plain)
            await step(hidden)
        seen = list(STEPS)
    return [s for h, s in seen if not h], [s for h, s in seen if h]


def decision_seconds(router: MlpRouter, hidden: np.ndarray, repeats: int = 2000) -> float:
    signal = signal_of(np.random.default_rng(0).normal(0, 3, 1000), 5, lambda t: "word", hidden)
    started = time.perf_counter()
    for _ in range(repeats):
        router.score_signal(signal)
    return (time.perf_counter() - started) / repeats


def random_router(units: int, n_embd: int) -> MlpRouter:
    rng = np.random.default_rng(0)
    inputs = len(FEATURES) + n_embd
    return MlpRouter(rng.normal(0, 0.05, (units, inputs)), np.zeros(units), rng.normal(0, 0.1, units), 0.0,
                     np.zeros(inputs), np.ones(inputs), {0.1: 0.5}, "bench", {})


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    local = await LocalModel.load(resolve_model(args.model), n_ctx=1024, n_threads=args.threads, n_batch=256,
                                  queue_limit=8, parallel=8)
    record_steps()
    await paired_steps(local, 1, 4)  # warm-up: page in the weights
    print(f"model {args.model}, {args.steps} paired decode steps, {args.threads} threads")
    print("sequences | ms/step without hidden | ms/step with hidden | overhead (median paired difference)")
    one_step = 0.0
    for count in (1, 4):
        local.engine.forget()
        without, with_ = await paired_steps(local, count, args.steps)
        base = statistics.median(without)
        extra = statistics.median([b - a for a, b in zip(without, with_)])
        one_step = one_step or base
        print(f"{count:9d} | {base * 1e3:22.2f} | {statistics.median(with_) * 1e3:19.2f} | "
              f"{extra * 1e3:+.3f} ms = {100 * extra / base:+.2f}%")
    hidden = np.random.default_rng(1).normal(0, 1, local.n_embd).astype(np.float32)
    for units in (64, 128):
        seconds = decision_seconds(random_router(units, local.n_embd), hidden)
        print(f"mlp decision ({units} units, {len(FEATURES)} + {local.n_embd} inputs): {seconds * 1e6:6.1f} us"
              f" = {100 * seconds / one_step:.3f}% of a one-sequence step (target < 1%)")
    local.close()


if __name__ == "__main__":
    asyncio.run(main())
