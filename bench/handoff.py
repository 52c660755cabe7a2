"""What a hand-off costs: local-only against routed with span 1 and routed with a longer span.

Run: .venv/bin/python -m bench.handoff [--local smollm2-135m-instruct] [--upstream qwen2.5-coder-0.5b-instruct]
                                       [--dataset csqa] [--rows 0:8] [--policy top1 --threshold 0.37]
                                       [--span 4 --until word]

The local model decodes in this process (one thread); the upstream is llama.cpp's llama-server on
loopback (one thread) in tokens mode, warmed with each prompt, as the embedded default runs it.
Each question is decoded under the three configurations in turn (so drift on this noisy machine
hits all three alike), greedy, each from a cold upstream (its cache erased, so no configuration
reads another's prompt). Printed per answer: wall time and its ratio to local-only, upstream
calls, billed prompt / cached / completion tokens, the tokens the upstream actually evaluated
(prompt not cached + completion) and the upstream's own compute time.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field

from adapters.local_model import LocalModel
from adapters.model_files import resolve_model
from adapters.upstream import Upstream
from adapters.upstream_server import UpstreamServer, forgetful_args
from bench import decoding_for, timed
from fitting.datasets import load_items
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.decoding.values import RequestRouting
from gateway.runtime import make_upstream
from gateway.settings import LaunchSettings, UpstreamSettings
from gateway.settings.routing_values import HandoffRule
from policies import build_policy


@dataclass
class Totals:
    wall_s: float = 0.0
    answers: int = 0
    calls: int = 0
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    compute_ms: float = 0.0
    tokens: list[int] = field(default_factory=list)

    def add(self, wall_s: float, decoding: Decoding) -> None:
        u = decoding.usage
        self.wall_s += wall_s
        self.answers += 1
        self.calls += u.upstream_calls
        self.prompt += u.upstream_prompt_tokens
        self.cached += u.upstream_cached_tokens
        self.completion += u.upstream_completion_tokens
        self.compute_ms += u.upstream_compute_ms
        self.tokens.append(len(decoding.answer_tokens))

    def row(self, name: str, local_wall_s: float) -> str:
        n = max(1, self.answers)
        evaluated = self.prompt - self.cached + self.completion
        return (f"| {name} | {self.wall_s / n:.2f} | {self.wall_s / local_wall_s:.2f} | {self.calls / n:.1f} | "
                f"{self.prompt / n:.0f} / {self.cached / n:.0f} / {self.completion / n:.1f} | {evaluated / n:.0f} | "
                f"{self.compute_ms / n:.0f} | {sum(self.tokens) / n:.1f} |")


async def decode(local: LocalModel, upstream: Upstream | None, messages: list[dict], max_tokens: int, policy: str,
                 threshold: float | None, span: int, until: str) -> tuple[float, Decoding]:
    routing = RequestRouting(build_policy(policy, threshold=threshold), HandoffRule(span, until))
    request = DecodeRequest(messages=messages, max_tokens=max_tokens, routing=routing)
    decoding = decoding_for(local, upstream, request)
    return await timed(decoding), decoding


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", default="smollm2-135m-instruct")
    parser.add_argument("--upstream", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dataset", default="csqa")
    parser.add_argument("--rows", default="0:8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--policy", default="top1")
    parser.add_argument("--threshold", type=float, default=0.37)
    parser.add_argument("--span", type=int, default=4)
    parser.add_argument("--until", default="word", choices=["tokens", "word", "line", "sentence"])
    args = parser.parse_args()
    local = await LocalModel.load(resolve_model(args.local), n_ctx=2048, n_threads=1, n_batch=256, queue_limit=4)
    launch = LaunchSettings(gguf=args.upstream, n_threads=1, n_ctx=2048, extra_args=forgetful_args())
    server = UpstreamServer(resolve_model(args.upstream), launch, alias="up")
    configs = {"local only": (None, "never", 1, "tokens"), "routed, span 1": ("up", args.policy, 1, "tokens"),
               f"routed, span {args.span} until {args.until}": ("up", args.policy, args.span, args.until)}
    totals = {name: Totals() for name in configs}
    try:
        await server.wait_ready()
        upstream = make_upstream("up", UpstreamSettings(
            model="text-completion-openai/up", api_base=server.api_base, mode="tokens", template_gguf=args.upstream,
            warm=True, retries=0, timeout_s=120, cache_isolation="shared"))
        for item in load_items(args.dataset, rows=args.rows):
            for name, (up, policy, span, until) in configs.items():
                await server.forget(launch.parallel)  # every answer starts from a cold upstream
                wall, decoding = await decode(local, upstream if up else None, item.messages, args.max_tokens,
                                              policy, args.threshold if up else None, span, until)
                totals[name].add(wall, decoding)
    finally:
        server.stop()
        local.close()
    local_wall = totals["local only"].wall_s
    print(f"{args.dataset} rows {args.rows}: local {args.local}, upstream {args.upstream} (llama-server, tokens mode, "
          f"warmed), {args.policy}@{args.threshold}, up to {args.max_tokens} answer tokens, per answer:")
    print("| config | wall s | x local | upstream calls | billed prompt / cached / completion | evaluated upstream "
          "| upstream compute ms | answer tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, total in totals.items():
        print(total.row(name, local_wall))


if __name__ == "__main__":
    asyncio.run(main())
