"""One stream, step by step: where the engine's decode step differs from llama.cpp's own tool.

Run: .venv/bin/python -m bench.single_stream [--model smollm2-135m-instruct] [--threads 2] [--repeat 7]

Times one sequence's decode steps (a 64-token prompt, then `--tokens` steps of one token each) on
a ladder of sides that differ from the next in one thing, each in a process of its own (two
threads of one process that both call llama_decode slow each other down: each gets an OpenMP team
of its own on the same cores), next to `llama-batched-bench` at one sequence (same model file,
threads, prompt and generated lengths). The sides take turns within every repeat, so the machine's
drift hits all alike; the medians over repeats are printed as ms per step and as a speed relative
to the tool.

  tool ctx   llama_decode through llama-cpp-python's ctypes bindings, in a context set as the
             tool sets its own: n_ctx 8192, batch = ubatch = 512, flash attention auto (on, on CPUs)
  fa off     the same with flash attention off (llama-cpp-python's default)
  engine ctx the engine's own context (adapters/engine.py: n_ctx 1024, unified KV cache, batch =
             ubatch = 512, flash attention on, its threadpool attached)
  engine     Sequence.forward from an event loop, one token at a time (the engine thread's step
             loop and its hand-over to the event loop), without the engine's guess of the next
             greedy token
  decoder    the whole collaborative decoder with policy `never` (signals, policy, detokenising),
             without guesses
  look-ahead the same decoder with the engine's look-ahead, as served: the engine evaluates each
             greedy token before the decoder asks for it, so the hand-over and the decoder's work
             overlap the next step
  served, fa off  the same with the engine's flash attention off (`flash_attn: false`)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp import _internals as internals

from adapters import engine as engine_module
from adapters.local_model import LocalModel
from adapters.model_files import resolve_model
from bench import decoding_for, llama_batched_bench
from gateway.decoding.decoder import DecodeRequest

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 64
QUESTION = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


@dataclass(frozen=True)
class Variant:
    name: str
    n_ctx: int
    flash_attn: int  # llama_cpp.LLAMA_FLASH_ATTN_TYPE_*
    poll: int


def variants() -> list[Variant]:
    off, auto = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED, llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    return [Variant("tool ctx", 8192, auto, 50), Variant("fa off", 8192, off, 50),
            Variant("engine ctx", 1024, engine_module.FLASH_ATTN[True], engine_module.THREADPOOL_POLL)]


class RawStream:
    """One sequence in a context of its own with `variant`'s settings: prefill, then greedy steps."""

    def __init__(self, llm: Llama, variant: Variant, threads: int) -> None:
        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_ctx, params.n_seq_max, params.kv_unified = variant.n_ctx, 1, True
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = variant.flash_attn
        self._context = internals.LlamaContext(model=llm._model, params=params, verbose=False)  # noqa: SLF001
        self._pool = engine_module.Threadpool(threads, poll=variant.poll)
        self._pool.attach(self._context.ctx)
        self._batch = llama_cpp.llama_batch_init(512, 0, 1)
        self._n_vocab = llm.n_vocab()

    def steps_ms(self, prompt: list[int], steps: int) -> float:
        """Median milliseconds of one decode step (decode + logits read) after `prompt`."""
        ctx = self._context.ctx
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        self._put(prompt, 0)
        times = []
        for position in range(len(prompt), len(prompt) + steps):
            started = time.perf_counter()
            if llama_cpp.llama_decode(ctx, self._batch) != 0:
                raise RuntimeError("llama_decode failed")
            view = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, self._batch.n_tokens - 1),
                                         shape=(self._n_vocab,))
            token = int(np.argmax(view))
            times.append(time.perf_counter() - started)
            self._put([token], position)
        return 1000 * statistics.median(times[1:])  # the first timed decode is the prompt's

    def _put(self, tokens: list[int], start: int) -> None:
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i] = token, start + i
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
            batch.logits[i] = i == len(tokens) - 1

    def close(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        self._context.close()
        self._pool.free()


def engine_ms(local: LocalModel, prompt: list[int], steps: int) -> float:
    """Median milliseconds of one Sequence.forward step (greedy, one token at a time)."""
    async def run() -> float:
        tokens, times = list(prompt), []
        async with local.sequence(tokens) as sequence:
            for _ in range(steps + 1):
                started = time.perf_counter()
                logits = await sequence.forward(list(tokens))
                times.append(time.perf_counter() - started)
                tokens.append(int(np.argmax(logits)))
        return 1000 * statistics.median(times[1:])
    return asyncio.run(run())


def decoder_ms(local: LocalModel, steps: int) -> float:
    """Milliseconds per token of the collaborative decoder (policy `never`) after its first token."""
    async def run() -> float:
        request = DecodeRequest(messages=QUESTION, max_tokens=steps)
        decoding = decoding_for(local, None, request)
        first = None
        async for piece in decoding.pieces():
            if first is None and piece.tokens:
                first = time.perf_counter()
        produced = len(decoding.answer_tokens)
        return 1000 * (time.perf_counter() - first) / max(1, produced - 1)
    return asyncio.run(run())


def tool_ms(model: Path, threads: int, steps: int) -> float:
    """llama-batched-bench's milliseconds per generated token at one sequence (1000 / S_TG)."""
    return 1000 / llama_batched_bench(model, threads, PROMPT_TOKENS, steps, [1])[1].s_tg


SIDES = ("tool", *(variant.name for variant in variants()), "engine", "decoder", "look-ahead", "served, fa off")


def side_ms(side: str, model: Path, threads: int, steps: int) -> float:
    """One measurement of `side` in this process (a fresh one per measurement)."""
    if side == "tool":
        return tool_ms(model, threads, steps)
    llm = Llama(model_path=str(model), n_ctx=64, n_batch=64, n_threads=threads, verbose=False)
    prompt = llm.tokenize(b"Once upon a time, " * 40, add_bos=True)[:PROMPT_TOKENS]
    variant = next((v for v in variants() if v.name == side), None)
    if variant is not None:
        stream = RawStream(llm, variant, threads)
        stream.steps_ms(prompt, 8)  # warm-up: weights paged in, graph allocated
        try:
            return stream.steps_ms(prompt, steps)
        finally:
            stream.close()
    local = asyncio.run(LocalModel.load(model, n_ctx=1024, n_threads=threads, n_batch=512, queue_limit=8,
                                        flash_attn=side != "served, fa off"))
    local.engine.speculation = side in ("look-ahead", "served, fa off")
    try:
        engine_ms(local, prompt, 8)
        return engine_ms(local, prompt, steps) if side == "engine" else decoder_ms(local, steps)
    finally:
        local.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    path = resolve_model(args.model)
    if args.side:
        print(side_ms(args.side, path, args.threads, args.tokens))
        return
    measured: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(args.repeat):
        for side in SIDES:
            child = subprocess.run([sys.executable, "-m", "bench.single_stream", "--side", side, "--model", args.model,
                                    "--threads", str(args.threads), "--tokens", str(args.tokens)],
                                   cwd=ROOT, capture_output=True, text=True, check=True)
            measured[side].append(float(child.stdout.strip().splitlines()[-1]))
    print(f"{args.model}, {args.threads} threads, {PROMPT_TOKENS}-token prompt, {args.tokens} steps, "
          f"{args.repeat} repeats taken in turn, each side in a process of its own")
    print("side            ms/step  speed/tool  repeats (ms/step; speed/tool is the median of each repeat's ratio)")
    for side, values in measured.items():
        ratio = statistics.median(tool / ms for tool, ms in zip(measured["tool"], values))
        print(f"{side:14s}  {statistics.median(values):7.2f}  {ratio:10.2f}  {', '.join(f'{v:.2f}' for v in values)}")
    paired = statistics.median(plain / ahead for plain, ahead in zip(measured["decoder"], measured["look-ahead"]))
    print(f"look-ahead / decoder speed, paired per repeat: {paired:.3f}")
    paired = statistics.median(off / on for off, on in zip(measured["served, fa off"], measured["look-ahead"]))
    print(f"look-ahead, flash attention on / off speed, paired per repeat: {paired:.3f}")


if __name__ == "__main__":
    main()
