"""Fair share of the local model: another tenant's small requests, alone and while one tenant sends
the heaviest agreement request the API allows (n x samples = 16 answers, adapters/slot_queue.py).

Run: .venv/bin/python -m bench.fair_share [--model smollm2-135m-instruct] [--heavy-tokens 256]
                                           [--small 8] [--small-tokens 16] [--parallel 4]

One gateway (`python -m gateway serve`, local-only alias, memory store, `--parallel` sequences, the
embedded queue limit of 16). The small requests are sent one after another, greedy, distinct
questions: first alone, then while the heavy request (n 2, agreement samples 8 at temperature 2,
`--heavy-tokens` each) decodes, and beside one ordinary request of one such answer (the floor: a
step of two sequences against a step of one). Prints each phase's median and slowest latency, their
ratios to the lone phase, and how many small requests were refused. Target: the median within 2x
of alone, none refused. Before the fair share (security round four) the same heavy request queued
its 16 answers ahead of everyone: other tenants got 503 or waited 38 s instead of 0.1-0.7 s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.support import DEMO_KEY, gateway_config, live_gateway

HEAVY_KEY = "sk-heavy"
QUESTIONS = ("What is the capital of France?", "Name a primary colour.", "What is 7 times 6?",
             "Which planet is the largest?", "What do bees make?", "How many legs has a spider?",
             "What is frozen water called?", "Which ocean is the largest?", "What gas do plants take in?",
             "What is the opposite of hot?")


def config(model: str, parallel: int) -> dict:
    settings = gateway_config(None)
    settings["server"].update(queue_limit=16, max_tokens_limit=1024)
    settings["models"]["local"]["smol"].update(gguf=model, parallel=parallel)
    settings["tenants"].append({"id": "heavy", "api_key_env": "BENCH_HEAVY_KEY"})
    return settings


def small_requests(base: str, count: int, tokens: int) -> tuple[list[float], int]:
    """Latencies of `count` small requests sent one after another, and how many were refused."""
    latencies, refused = [], 0
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {DEMO_KEY}"}, timeout=300) as client:
        for index in range(count):
            body = {"model": "local", "max_tokens": tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]}
            start = time.perf_counter()
            response = client.post("/v1/chat/completions", json=body)
            latencies.append(time.perf_counter() - start)
            refused += response.status_code != 200
    return latencies, refused


STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]
AGREEMENT = {"answer_check": {"kind": "agreement", "samples": 8, "temperature": 2.0, "format": "text"}}


def background(base: str, body: dict, done: threading.Event, took: list[float]) -> None:
    """Send `body` as the heavy tenant; append its wall time to `took`, then set `done`."""
    start = time.perf_counter()
    httpx.post(f"{base}/v1/chat/completions", json=body, timeout=3600,
               headers={"Authorization": f"Bearer {HEAVY_KEY}"}).raise_for_status()
    took.append(time.perf_counter() - start)
    done.set()


def beside(base: str, body: dict, args: argparse.Namespace) -> tuple[list[float], int, bool, float]:
    """The small requests while `body` decodes: their latencies, refusals, whether `body` was still
    decoding when the last was answered, and `body`'s own wall time."""
    done, took = threading.Event(), []
    worker = threading.Thread(target=background, args=(base, body, done, took))
    worker.start()
    time.sleep(1.0)  # its answers are decoding and queued
    latencies, refused = small_requests(base, args.small, args.small_tokens)
    overlapped = not done.is_set()
    worker.join()
    return latencies, refused, overlapped, took[0]


def report(name: str, latencies: list[float], refused: int, alone: float) -> None:
    median, slowest = statistics.median(latencies), max(latencies)
    print(f"{name:<16} median {median:6.3f} s ({median / alone:4.2f}x)  slowest {slowest:6.3f} s "
          f"({slowest / alone:4.2f}x)  refused {refused}/{len(latencies)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--heavy-tokens", type=int, default=256)
    parser.add_argument("--small", type=int, default=8)
    parser.add_argument("--small-tokens", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args()
    ordinary = {"model": "local", "max_tokens": args.heavy_tokens, "temperature": 0, "messages": STORY}
    heaviest = {**ordinary, "n": 2, "routing": AGREEMENT}
    with tempfile.TemporaryDirectory() as tmp, \
            live_gateway(config(args.model, args.parallel), Path(tmp), env={"BENCH_HEAVY_KEY": HEAVY_KEY}) as gateway:
        base = gateway.base_url
        small_requests(base, 2, args.small_tokens)  # warm
        alone, refused_alone = small_requests(base, args.small, args.small_tokens)
        heavy_alone: list[float] = []
        background(base, heaviest, threading.Event(), heavy_alone)
        one = beside(base, ordinary, args)
        heavy = beside(base, heaviest, args)
    lone = statistics.median(alone)
    print(f"small requests: {args.small} x {args.small_tokens} tokens; ordinary: one answer of {args.heavy_tokens} "
          f"tokens; heaviest: n 2 x 8 answers x {args.heavy_tokens} tokens; {args.parallel} sequences")
    report("alone", alone, refused_alone, lone)
    report("beside ordinary", one[0], one[1], lone)
    report("beside heaviest", heavy[0], heavy[1], lone)
    print(f"the other request still decoding when the last small one was answered: ordinary {one[2]}, "
          f"heaviest {heavy[2]}")
    print(f"heaviest request: {heavy_alone[0]:.1f} s alone, {heavy[3]:.1f} s beside the small ones "
          f"({heavy[3] / heavy_alone[0]:.2f}x)")


if __name__ == "__main__":
    main()
