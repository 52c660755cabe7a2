"""Latency hiding: how much of the time hand-offs add does guessing ahead win back?

Run: .venv/bin/python -m bench.guessing [--local smollm2-135m-instruct] [--upstream qwen2.5-coder-0.5b-instruct]
                                        [--rtt-ms 100] [--share 0.1] [--rounds 1] [--guess-ahead 8]

The local model decodes (one thread); the upstream is a llama-cpp-python server process on
loopback (one thread) behind an injected round trip of `--rtt-ms`; `target_fraction` routes about
`--share` of the answer tokens. For each prompt it decodes local-only, then (the routed lanes
taking turns to go first) routed without guessing, routed guessing along the local top choice, and
routed guessing along the top choice and the runner-up (a second sequence, `guess_runner_up`); it
reports each routed lane's wall time over local-only, the share of the hand-offs' added time that
guessing removes (target >= 0.5), how many guessed tokens were kept, and which line each hand-off
kept.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any

from adapters.local_model import LocalModel
from adapters.model_files import resolve_model
from adapters.upstream_server import UpstreamServer
from bench import decoding_for, timed
from gateway.decoding.decoder import GUESS_LIMIT, DecodeRequest, Decoding
from gateway.runtime import make_upstream
from gateway.settings import LaunchSettings, UpstreamSettings
from policies import build_policy

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "Describe a walk through a forest in autumn.", "Tell me about the history of bread."]


@dataclass
class Delayed:
    """An upstream whose every call takes `rtt_s` longer, as a remote provider's would."""

    inner: Any
    rtt_s: float

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def continue_text(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(self.rtt_s)
        return await self.inner.continue_text(*args, **kwargs)


LANES = {"routed": False, "guessing": False, "runner-up": True}  # name: guessing along the runner-up too


async def decode(local: LocalModel, upstream: Any, prompt: str, tokens: int, policy: str, guess: int,
                 share: float) -> tuple[float, Decoding]:
    request = DecodeRequest(messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
                            policy=build_policy(policy, target_fraction=share), guess_ahead=guess)
    decoding = decoding_for(local, upstream, request)
    return await timed(decoding), decoding


@dataclass
class Lane:
    """One routed configuration's totals over the prompts."""

    wall: float = 0.0
    kept: int = 0
    calls: int = 0
    upstream_tokens: int = 0
    lines: list[int] = field(default_factory=lambda: [0, 0, 0])

    def add(self, wall: float, decoding: Decoding) -> None:
        self.wall += wall
        self.kept += decoding.usage.guess_kept_tokens
        self.calls += decoding.usage.upstream_calls
        self.upstream_tokens += decoding.source_counts()["upstream"]
        self.lines = [a + b for a, b in zip(self.lines, decoding.usage.guessed_handoffs)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", default="smollm2-135m-instruct")
    parser.add_argument("--upstream", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rtt-ms", type=float, default=100.0)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1, help="times through the prompts")
    parser.add_argument("--guess-ahead", type=int, default=GUESS_LIMIT, help="most tokens a guess runs ahead")
    args = parser.parse_args()
    # two sequences, so that a branch can take the second
    local = await LocalModel.load(resolve_model(args.local), n_ctx=1024, n_threads=1, n_batch=256,
                                  queue_limit=4, parallel=2)
    launch = LaunchSettings(gguf=args.upstream, server="llama-cpp-python", n_threads=1, n_ctx=2048)
    server = UpstreamServer(resolve_model(args.upstream), launch, alias="up")
    try:
        await server.wait_ready()
        settings = UpstreamSettings(model="text-completion-openai/up", api_base=server.api_base, mode="completions",
                                    template_gguf=args.upstream, extra_body={"repeat_penalty": 1.0}, retries=0,
                                    cache_isolation="shared")
        upstream = Delayed(make_upstream("up", settings), args.rtt_ms / 1000)
        local_wall, lanes = 0.0, {name: Lane() for name in LANES}
        for turn, prompt in enumerate(PROMPTS * args.rounds):
            local_wall += (await decode(local, None, prompt, args.tokens, "never", 0, args.share))[0]
            names = list(LANES)[turn % len(LANES):] + list(LANES)[:turn % len(LANES)]  # each lane goes first in turn
            for name in names:
                local.branches = LANES[name]
                guess = 0 if name == "routed" else args.guess_ahead
                lanes[name].add(*await decode(local, upstream, prompt, args.tokens, "target_fraction", guess,
                                              args.share))
    finally:
        server.stop()
        local.close()
    print(f"{len(PROMPTS) * args.rounds} answers, {args.tokens} tokens, local {args.local}, upstream {args.upstream} "
          f"+ {args.rtt_ms:.0f} ms, target share {args.share}")
    added = lanes["routed"].wall - local_wall
    print(f"wall s: local {local_wall:.1f}, " + ", ".join(
        f"{name} {lane.wall:.1f} ({lane.wall / local_wall:.2f}x)" for name, lane in lanes.items()))
    for name in ("guessing", "runner-up"):
        lane = lanes[name]
        top, second, none = lane.lines
        print(f"{name}: hand-off time removed {1 - (lane.wall - local_wall) / added:.0%} (target >= 50%); "
              f"{lane.calls} hand-offs, {lane.upstream_tokens} upstream tokens, {lane.kept} guessed tokens kept "
              f"({lane.kept / max(1, lane.calls):.1f} per hand-off); guess confirmed along the top choice "
              f"{top}, the runner-up {second}, neither {none}")


if __name__ == "__main__":
    asyncio.run(main())
