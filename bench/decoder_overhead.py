"""Decoder overhead: llama-cpp-python's own greedy loop vs the collaborative decoder with `never`.

Run: .venv/bin/python -m bench.decoder_overhead [--model smollm2-135m-instruct] [--rounds 5]

Both decode the same prompt for the same number of tokens with the same thread count, alternating
A/B in one process so machine noise hits both alike. Prints tokens/s of each and their ratio
(goal >= 0.95), and the time of signal extraction plus the policy decision per step as a share of
a step (goal < 1%).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
from llama_cpp import Llama

from adapters.local_model import LocalModel
from adapters.model_files import resolve_model
from bench import decoding_for, timed
from gateway.decoding.decoder import DecodeRequest
from gateway.decoding.signals import signal_of
from policies import RoutingState, build_policy

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def llama_greedy(llm: Llama, tokens: list[int], count: int) -> float:
    llm.reset()
    started = time.perf_counter()
    produced = 0
    for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        produced += 1
        if produced >= count:
            break
    return produced / (time.perf_counter() - started)


async def decoder_never(local: LocalModel, count: int) -> float:
    request = DecodeRequest(messages=PROMPT, max_tokens=count)  # local only
    decoding = decoding_for(local, None, request)
    local.engine.forget()  # start cold, as llama_greedy does after reset()
    seconds = await timed(decoding)
    return len(decoding.answer_tokens) / seconds


def signal_and_policy_seconds(logits: np.ndarray, repeats: int = 2000) -> float:
    policy = build_policy("entropy", threshold=2.0)
    state = RoutingState()
    started = time.perf_counter()
    for position in range(repeats):
        policy.decide(signal_of(logits, position), state)
    return (time.perf_counter() - started) / repeats


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = resolve_model(args.model)
    local = await LocalModel.load(path, n_ctx=2048, n_threads=args.threads, n_batch=256, queue_limit=1)
    llm = Llama(str(path), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    tokens = local.tokenize_prompt(local.template.render_parts(PROMPT))
    llama_greedy(llm, tokens, 8)  # warm-up: page in the weights for both
    await decoder_never(local, 8)
    baseline, ours = [], []
    for _ in range(args.rounds):
        baseline.append(llama_greedy(llm, tokens, args.tokens))
        ours.append(await decoder_never(local, args.tokens))
    async with local.sequence(tokens) as sequence:
        logits = await sequence.forward(tokens)
    per_step = signal_and_policy_seconds(logits)
    step = 1.0 / statistics.median(ours)
    print(f"model {args.model}, {args.tokens} tokens, {args.threads} threads, {args.rounds} alternating rounds")
    print(f"llama-cpp-python greedy   : {statistics.median(baseline):7.1f} tok/s (runs: {', '.join(f'{x:.1f}' for x in baseline)})")
    print(f"decoder, policy=never     : {statistics.median(ours):7.1f} tok/s (runs: {', '.join(f'{x:.1f}' for x in ours)})")
    print(f"ratio decoder / llama     : {statistics.median(ours) / statistics.median(baseline):7.3f}  (goal >= 0.95)")
    print(f"signal + policy per step  : {per_step * 1e6:7.1f} us = {100 * per_step / step:.2f}% of a {step * 1e3:.1f} ms step (goal < 1%)")
    local.close()


if __name__ == "__main__":
    asyncio.run(main())
