"""What a JSON grammar costs the local decoder: free text vs response_format json_schema, side by side.

Run: .venv/bin/python -m bench.grammar [--model qwen2.5-coder-0.5b-instruct] [--rounds 3]

Decodes the same structured-output prompt greedily without and with the grammar (alternating, in
one process), and prints tokens/s of each with their ratio, how many local steps needed the
full-vocabulary mask (the sampled token was one the grammar forbids), and the cost of one mask and
of one single-token check on this model's vocabulary.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from adapters.grammar import Grammar, gbnf_for
from adapters.local_model import LocalModel
from adapters.model_files import resolve_model
from bench import decoding_for, timed
from fitting.datasets import GSM8K_JSON_SCHEMA, load_items
from gateway.decoding.decoder import DecodeRequest


class CountingGrammar(Grammar):
    """A Grammar that counts its full-vocabulary masks."""

    masks = 0

    def mask(self, answer, logits):
        CountingGrammar.masks += 1
        return super().mask(answer, logits)


async def decode(local: LocalModel, messages: list[dict], tokens: int, grammar: str | None) -> tuple[float, int]:
    request = DecodeRequest(messages=messages, max_tokens=tokens, grammar=grammar)
    decoding = decoding_for(local, None, request)
    seconds = await timed(decoding)
    return len(decoding.answer_tokens) / seconds, len(decoding.answer_tokens)


def costs(local: LocalModel, gbnf: str, repeats: int = 20) -> tuple[float, float]:
    """Seconds of one full mask and of one single-token check, mid-answer."""
    grammar = local.grammar(gbnf)
    answer = local.tokenize_text(b'{"reasoning": "She has 16 eggs and eats 3')
    logits = np.zeros(local.n_vocab, dtype=np.float32)
    grammar.mask(answer, logits)
    started = time.perf_counter()
    for _ in range(repeats):
        grammar.mask(answer, logits)
    mask_s = (time.perf_counter() - started) / repeats
    started = time.perf_counter()
    for _ in range(repeats * 50):
        grammar.allows(answer, answer[-1])
    check_s = (time.perf_counter() - started) / (repeats * 50)
    grammar.close()
    return mask_s, check_s


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--questions", type=int, default=4, help="GSM8K rows (structured prompt)")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    local = await LocalModel.load(resolve_model(args.model), n_ctx=2048, n_threads=args.threads, n_batch=256,
                                  queue_limit=1)
    local.grammar = lambda gbnf: CountingGrammar(local._vocab, local.n_vocab, gbnf)  # noqa: SLF001
    gbnf = gbnf_for("json_schema", GSM8K_JSON_SCHEMA)
    items = load_items("gsm8k_json", rows=f"0:{args.questions}")
    free, constrained, steps = [], [], 0
    await decode(local, items[0].messages, 8, None)  # warm-up
    for _ in range(args.rounds):
        for item in items:
            free.append((await decode(local, item.messages, args.tokens, None))[0])
            rate, count = await decode(local, item.messages, args.tokens, gbnf)
            constrained.append(rate)
            steps += count
    mask_s, check_s = costs(local, gbnf)
    step_s = 1.0 / statistics.median(free)
    print(f"model {args.model} (vocabulary {local.n_vocab}), {len(items)} questions x {args.rounds} rounds, "
          f"{args.threads} threads")
    print(f"  free text      {statistics.median(free):6.1f} tok/s")
    print(f"  json_schema    {statistics.median(constrained):6.1f} tok/s  "
          f"ratio {statistics.median(constrained) / statistics.median(free):.3f}")
    print(f"  full masks     {CountingGrammar.masks} in {steps} grammar steps ({CountingGrammar.masks / max(1, steps):.1%})")
    print(f"  one mask       {mask_s * 1000:6.2f} ms = {mask_s / step_s:.2f} decode steps")
    print(f"  one check      {check_s * 1e6:6.1f} us = {check_s / step_s:.2%} of a decode step")
    local.close()


if __name__ == "__main__":
    asyncio.run(main())
