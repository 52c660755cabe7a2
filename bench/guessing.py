"""Latency hiding: how much of the time hand-offs add does guessing ahead win back?

Run: .venv/bin/python -m bench.guessing [--local smollm2-135m-instruct] [--upstream qwen2.5-coder-0.5b-instruct]
                                        [--rtt-ms 100] [--share 0.1] [--rounds 1]

The local model decodes (one thread); the upstream is a llama-cpp-python server process on
loopback (one thread) behind an injected round trip of `--rtt-ms`; `target_fraction` routes about
`--share` of the answer tokens. For each prompt, alternating, it decodes local-only, routed
without guessing and routed with guessing (greedy), and reports routed wall time over local-only
wall time for both, the share of the hand-offs' added time that guessing removes (target >= 0.5),
how many guessed tokens were kept, and how many hand-offs dropped their guess whole (the upstream
wrote something else first): only the others can hide any of their time.

It does so twice. With the live upstream, a hand-off takes the round trip plus the upstream's
compute on this machine's other core. Then with the upstream's answers replayed: each hand-off
gets the answer the live upstream gave it, after the round trip alone, as from a provider whose
compute is quick and off this machine (greedy decoding asks the same hand-offs with and without
guessing; one the live passes never asked goes to the live upstream and is counted).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from adapters.continuation_modes import Handoff
from adapters.local_model import LocalModel
from adapters.model_files import resolve_model
from adapters.upstream_server import UpstreamServer
from bench import decoding_for, timed
from gateway.decoding.decoder import GUESS_LIMIT, DecodeRequest, Decoding
from gateway.decoding.values import RequestRouting
from gateway.runtime import make_upstream
from gateway.settings import LaunchSettings, UpstreamSettings
from policies import build_policy

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "Describe a walk through a forest in autumn.", "Tell me about the history of bread."]


def asked(handoff: Handoff, max_tokens: int) -> tuple:
    """What a hand-off asks the upstream, as a key of the answers recorded live."""
    return handoff.text, tuple(handoff.ids), max_tokens


@dataclass
class Delayed:
    """An upstream whose every call takes `rtt_s` longer, as a remote provider's would; it keeps
    each hand-off's answer, so that `Replayed` can give it again."""

    inner: Any
    rtt_s: float
    answers: dict[tuple, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def continue_text(self, handoff: Handoff, max_tokens: int, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(self.rtt_s)
        answer = await self.inner.continue_text(handoff, max_tokens, *args, **kwargs)
        self.answers[asked(handoff, max_tokens)] = answer
        return answer


@dataclass
class Replayed:
    """`live`'s recorded answers after `live.rtt_s` alone; a hand-off it never saw goes to `live`."""

    live: Delayed
    misses: int = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.live, name)

    async def continue_text(self, handoff: Handoff, max_tokens: int, *args: Any, **kwargs: Any) -> Any:
        answer = self.live.answers.get(asked(handoff, max_tokens))
        if answer is None:
            self.misses += 1
            return await self.live.continue_text(handoff, max_tokens, *args, **kwargs)
        await asyncio.sleep(self.live.rtt_s)
        return dataclasses.replace(answer, latency_s=self.live.rtt_s)


@dataclass
class Tally:
    """Wall seconds of each way to decode, and what the guessing runs kept."""

    walls: dict[str, float] = field(default_factory=lambda: {"local": 0.0, "routed": 0.0, "guessing": 0.0})
    kept: int = 0
    routed_tokens: int = 0
    calls: int = 0
    dropped: int = 0

    def add_guessing(self, wall: float, decoding: Decoding) -> None:
        self.walls["guessing"] += wall
        self.kept += decoding.usage.guess_kept_tokens
        self.routed_tokens += decoding.source_counts()["upstream"]
        self.calls += decoding.usage.upstream_calls
        self.dropped += decoding.usage.guesses_dropped

    def print(self, title: str) -> None:
        walls = self.walls
        added, added_guessing = walls["routed"] - walls["local"], walls["guessing"] - walls["local"]
        print(f"{title}:")
        print(f"  wall s: local {walls['local']:.1f}, routed {walls['routed']:.1f} "
              f"({walls['routed'] / walls['local']:.2f}x), routed + guessing {walls['guessing']:.1f} "
              f"({walls['guessing'] / walls['local']:.2f}x)")
        print(f"  hand-off time removed by guessing: {1 - added_guessing / added:.0%} (target >= 50%)")
        print(f"  guessing run: {self.calls} hand-offs, {self.routed_tokens} upstream tokens, {self.kept} guessed "
              f"tokens kept ({self.kept / max(1, self.calls):.1f} per hand-off); {self.dropped} hand-offs dropped "
              f"their guess whole: {1 - self.dropped / max(1, self.calls):.0%} kept any (the rest hide nothing)")


async def decode(local: LocalModel, upstream: Any, prompt: str, tokens: int, policy: str, guess: int,
                 share: float) -> tuple[float, Decoding]:
    request = DecodeRequest(messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
                            routing=RequestRouting(build_policy(policy, target_fraction=share)), guess_ahead=guess)
    decoding = decoding_for(local, upstream, request)
    return await timed(decoding), decoding


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", default="smollm2-135m-instruct")
    parser.add_argument("--upstream", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rtt-ms", type=float, default=100.0)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--guess-ahead", type=int, default=GUESS_LIMIT)
    parser.add_argument("--rounds", type=int, default=1, help="times through the prompts")
    args = parser.parse_args()
    local = await LocalModel.load(resolve_model(args.local), n_ctx=1024, n_threads=1, n_batch=256,
                                  queue_limit=4)
    launch = LaunchSettings(gguf=args.upstream, server="llama-cpp-python", n_threads=1, n_ctx=2048)
    server = UpstreamServer(resolve_model(args.upstream), launch, alias="up")
    try:
        await server.wait_ready()
        settings = UpstreamSettings(model="text-completion-openai/up", api_base=server.api_base, mode="completions",
                                    template_gguf=args.upstream, extra_body={"repeat_penalty": 1.0}, retries=0,
                                    cache_isolation="shared")
        live = Delayed(make_upstream("up", settings), args.rtt_ms / 1000)
        replayed = Replayed(live)
        tallies = {"live": Tally(), "replayed": Tally()}
        for prompt in PROMPTS * args.rounds:
            local_wall = (await decode(local, None, prompt, args.tokens, "never", 0, args.share))[0]
            for upstream, tally in ((live, tallies["live"]), (replayed, tallies["replayed"])):
                tally.walls["local"] += local_wall
                tally.walls["routed"] += (await decode(local, upstream, prompt, args.tokens, "target_fraction", 0,
                                                       args.share))[0]
                tally.add_guessing(*await decode(local, upstream, prompt, args.tokens, "target_fraction",
                                                 args.guess_ahead, args.share))
    finally:
        server.stop()
        local.close()
    print(f"{len(PROMPTS) * args.rounds} answers, {args.tokens} tokens, local {args.local}, upstream {args.upstream} + "
          f"{args.rtt_ms:.0f} ms, target share {args.share}")
    tallies["live"].print("live upstream (its compute on this machine's other core)")
    tallies["replayed"].print(f"upstream answers replayed after the round trip alone ({replayed.misses} hand-offs "
                              f"not seen live)")


if __name__ == "__main__":
    asyncio.run(main())
