"""Concurrency: aggregate generation tokens/s and time to first token at 1, 2, 4 and 8 streams,
through the engine and through the gateway over HTTP, next to llama.cpp's own
`llama-batched-bench` on the same model and threads (the ceiling of this machine).

Run: .venv/bin/python -m bench.concurrency [--model smollm2-135m-instruct] [--threads 2] [--tokens 64]
                                           [--streams 1,2,4,8]

Each side runs in a process of its own, taking turns within each of `--repeat` repeats (the median
is shown): (1) the engine: N local-only decodings at once (the collaborative decoder, policy
`never`), in this process; (2) the gateway (`python -m gateway serve`, local-only alias, memory
store, `parallel` = the most streams): N streaming requests at once; (3) llama-batched-bench (built by scripts/build-llama-tools.sh from
the llama.cpp sources vendored in the pinned llama-cpp-python sdist) with N parallel sequences of
64 prompt and `--tokens` generated tokens. Prompts are distinct questions behind one shared system
prompt. Generation speed is llama-batched-bench's S_TG and, for ours, the sum over streams of
(tokens after the first) / (time from the first token to the last); answers may end early.
Targets, as ratios: speed-up from 1 to 4 and 8 streams >= 90% of the tool's, the slowest of 4
first tokens within 3x of a lone stream's, one stream >= 0.9x the tool's single sequence. What
the CPU allows for the first tokens is measured too: llama-batched-bench's time to prefill 4
distinct prompts as long as one question (the part after the shared system prompt) in one batch,
over its time for one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from adapters.engine import common_prefix
from adapters.local_model import LocalModel
from adapters.model_files import resolve_model
from adapters.upstream_server import free_port
from bench import decoding_for, llama_batched_bench
from bench.support import wait_http
from gateway.decoding.decoder import DecodeRequest

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a storyteller. Write vivid, flowing prose without lists or headings. " * 3
SUBJECTS = ("a lighthouse keeper", "a lost robot", "a desert caravan", "a mountain village", "a clockmaker",
            "a deep-sea diver", "a traveling circus", "an old library")
KEY = "sk-bench"
# A side's engine may still be decoding a look-ahead guess when its answers are in. Two llama.cpp
# thread teams on two cores then stall each other's barriers for seconds (measured: single 4-token
# steps of 1-5 s), so each side gets this long to go idle before the next begins.
SETTLE_S = 0.5


def config(model: str, threads: int, parallel: int, port: int) -> dict:
    return {
        "server": {"port": port, "queue_limit": 64, "max_tokens_limit": 1024},
        "models": {"local": {"m": {"gguf": model, "n_ctx": 1024, "n_threads": threads, "parallel": parallel}}},
        "aliases": {"local": {"local": "m", "routing": {"policy": "never"}}},
        "tenants": [{"id": "bench", "api_key_env": "BENCH_KEY"}],
    }


@dataclass(frozen=True)
class Stream:
    first_s: float  # from the round's start to the first token
    end_s: float
    tokens: int


SAME = -4  # a round of 4 streams that all send the same (uncached) question


def stream_index(streams: int, index: int) -> int:
    return 0 if streams == SAME else index


def messages(index: int, round_tag: int) -> list[dict[str, str]]:
    """Stream `index` of a round: a question no other round asks (its prompt is not cached),
    behind the shared system prompt (cached after the warm-up, as in steady state)."""
    subject = SUBJECTS[index % len(SUBJECTS)]
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Tell a long story about {subject}, in {round_tag + 2} parts."}]


def median_round(results: list[tuple[float, list[float]]]) -> tuple[float, list[float]]:
    """The round with the median speed (its first-token times come with it)."""
    return sorted(results, key=lambda result: result[0])[len(results) // 2]


def summary(streams: list[Stream]) -> tuple[float, list[float]]:
    """(aggregate generation tokens/s, first-token times) of one round."""
    speed = sum((s.tokens - 1) / (s.end_s - s.first_s) for s in streams if s.tokens > 1 and s.end_s > s.first_s)
    return speed, [s.first_s for s in streams]


async def engine_stream(local: LocalModel, index: int, round_tag: int, tokens: int, started: float) -> Stream:
    request = DecodeRequest(messages=messages(index, round_tag), max_tokens=tokens)
    decoding = decoding_for(local, None, request)
    first = None
    async for piece in decoding.pieces():
        if first is None and piece.tokens:
            first = time.perf_counter() - started
    return Stream(first or float("nan"), time.perf_counter() - started, len(decoding.answer_tokens))


async def engine_round(local: LocalModel, n: int, tokens: int, round_tag: int) -> tuple[float, list[float]]:
    started = time.perf_counter()
    return summary(await asyncio.gather(*(engine_stream(local, stream_index(n, i), round_tag, tokens, started)
                                          for i in range(abs(n)))))


async def http_stream(client: httpx.AsyncClient, index: int, round_tag: int, tokens: int, started: float) -> Stream:
    body = {"model": "local", "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "messages": messages(index, round_tag)}
    first, count = None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[len("data: "):])
            if first is None and any(c["delta"].get("content") for c in data["choices"]):
                first = time.perf_counter() - started
            if data.get("usage"):
                count = data["usage"]["completion_tokens"]
    return Stream(first or float("nan"), time.perf_counter() - started, count)


async def http_round(base_url: str, streams: int, tokens: int, round_tag: int) -> tuple[float, list[float]]:
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as client:
        started = time.perf_counter()
        return summary(await asyncio.gather(*(http_stream(client, stream_index(streams, i), round_tag, tokens, started)
                                              for i in range(abs(streams)))))


@contextlib.contextmanager
def gateway_process(args: argparse.Namespace, parallel: int) -> Iterator[str]:
    """A gateway process (local-only alias, memory store); yields its base URL."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(config(args.model, args.threads, parallel, port)))
        log = (Path(tmp) / "gateway.log").open("wb")
        process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT,
                                   env={**os.environ, "BENCH_KEY": KEY}, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_http(f"{base}/health/ready", process, timeout_s=120)
            yield base
        finally:
            process.terminate()
            process.wait(timeout=30)


def question_tokens(local: LocalModel) -> int:
    """Tokens of a question after the system prompt that all streams share (their own prefill)."""
    prompts = [local.tokenize_prompt(local.template.render_parts(messages(i, 0))) for i in range(4)]
    return statistics.median_low(len(p) - max(common_prefix(p, q) for q in prompts if q is not p) for p in prompts)


def measure(args: argparse.Namespace, counts: list[int]) -> tuple[dict, dict, dict]:
    """Median (over --repeat) of each side; the sides take turns within every repeat, so machine
    noise over the run hits all three alike."""
    rounds = [*counts, SAME]
    tool: dict[int, list[float]] = {n: [] for n in counts}
    engine: dict[int, list] = {n: [] for n in rounds}
    gateway: dict[int, list] = {n: [] for n in rounds}
    model = resolve_model(args.model)
    loop = asyncio.new_event_loop()
    local = loop.run_until_complete(LocalModel.load(model, n_ctx=1024, n_threads=args.threads,
                                                    n_batch=512, queue_limit=64, parallel=max(counts)))
    question = question_tokens(local)
    bound: list[float] = []
    try:
        with gateway_process(args, max(counts)) as base:
            loop.run_until_complete(engine_round(local, 1, 8, round_tag=0))  # warm-ups: weights, system prompt
            loop.run_until_complete(http_round(base, 1, 8, round_tag=0))
            for repeat in range(args.repeat):
                for n, row in llama_batched_bench(model, args.threads, 64, args.tokens, counts).items():
                    tool[n].append(row.s_tg)
                prefill = llama_batched_bench(model, args.threads, question, 1, [1, 4])
                bound.append(prefill[4].t_pp / prefill[1].t_pp)
                for n in rounds:  # a new round tag: no round's questions are cached
                    engine[n].append(loop.run_until_complete(engine_round(local, n, args.tokens, n + 10 * repeat)))
                    time.sleep(SETTLE_S)
                    gateway[n].append(loop.run_until_complete(http_round(base, n, args.tokens, n + 10 * repeat)))
                    time.sleep(SETTLE_S)
    finally:
        local.close()
        loop.close()
    print(f"llama-batched-bench: prefilling 4 distinct {question}-token prompts in one "
          f"batch takes {statistics.median(bound):.2f}x one's time (what this CPU allows the slowest first token)")
    return ({n: statistics.median(v) for n, v in tool.items()}, {n: median_round(v) for n, v in engine.items()},
            {n: median_round(v) for n, v in gateway.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per stream count (the median is shown)")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    ceiling, engine, gateway = measure(args, counts)
    print(f"model {args.model}, {args.threads} threads, {args.tokens} tokens per stream; generation tok/s "
          f"(x1: speed-up over one stream; /tool: that speed-up over llama-batched-bench's)")
    print("streams  batched-bench    x1 |  engine    x1  /tool  first token p50/p95/max s |"
          "  gateway    x1  /tool  first token p50/p95/max s")
    for n in counts:
        tool = ceiling[n] / ceiling[counts[0]]
        print(f"{n:7d}  {ceiling[n]:13.1f}  {tool:4.2f} | {row(engine, n, counts[0], tool)} | {row(gateway, n, counts[0], tool)}")
    for name, ours in (("engine", engine), ("gateway", gateway)):
        lone_speed, lone_first = ours[counts[0]][0], ours[counts[0]][1][0]
        if 4 in ours:
            print(f"{name}: slowest of 4 first tokens / lone first token: {max(ours[4][1]) / lone_first:.2f} "
                  f"(target <= 3); 4 identical questions: {max(ours[SAME][1]) / lone_first:.2f}")
        print(f"{name}: one stream / llama-batched-bench one sequence: {lone_speed / ceiling[counts[0]]:.2f} "
              f"(target >= 0.9)")


def row(ours: dict[int, tuple[float, list[float]]], n: int, lone: int, tool: float) -> str:
    speed, firsts = ours[n]
    ratio = speed / ours[lone][0]
    firsts = sorted(firsts)
    p95 = firsts[min(len(firsts) - 1, int(0.95 * len(firsts)))]
    return (f"{speed:7.1f}  {ratio:4.2f}  {ratio / tool:5.2f}  "
            f"{statistics.median(firsts):5.2f} / {p95:5.2f} / {firsts[-1]:5.2f}")


if __name__ == "__main__":
    main()
