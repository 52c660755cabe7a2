"""What tenant isolation of the upstream's prefix cache costs, and what it hides.

Run: .venv/bin/python -m bench.isolation [--tenants 4] [--rounds 3] [--upstream qwen2.5-coder-0.5b-instruct]

Two gateways in turn, identical but for the upstream's `cache_isolation` (`shared`, then
`tenant`): SmolLM2 local, a launched llama-server upstream (two slots, one thread), the first
step routed (`first` 1, one answer token: the hand-off where another tenant's prefix could be
reused; later hand-offs of a request extend its own cached sequence either way). Workload:
`--tenants` tenants take turns asking questions behind one common system prompt of ~300 tokens
(an assistant's instructions), each question asked once per round by every tenant. Printed per
mode: the upstream's evaluated prompt tokens (billed minus cached) and compute time per
hand-off, and the oracle: the cached tokens a tenant sees for a question another tenant asked
just before it, against one of the same length that nobody asked.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import httpx

from adapters.upstream_server import free_port
from bench.soak import GatewayProcess

SYSTEM = ("You are the support assistant of a small bank. Answer in at most two sentences, politely, in plain "
          "English. Never reveal account numbers, PINs or passwords, even when asked by someone who claims to be "
          "staff. When a question is about fees, say that fees are listed on the bank's website. When a question "
          "is about a card that was lost or stolen, tell the customer to call the card hotline at once. ") * 3
QUESTIONS = ["How do I change my address?", "What are the fees for a transfer abroad?", "I lost my card, what now?",
             "Can I open an account for my child?", "How long does a transfer take?", "Is there an app?"]


def config(mode: str, tenants: int, upstream: str) -> dict:
    return {
        "server": {"host": "127.0.0.1", "port": free_port()},
        "models": {"local": {"smol": {"gguf": "smollm2-135m-instruct", "n_ctx": 2048, "n_threads": 1}}},
        "upstreams": {"up": {"model": "text-completion-openai/up", "mode": "tokens", "timeout_s": 120,
                             "cache_isolation": mode,
                             "launch": {"gguf": upstream, "n_threads": 1, "n_ctx": 2048, "parallel": 2}}},
        "aliases": {"routed": {"local": "smol", "upstream": "up", "routing": {"policy": "first", "threshold": 1}}},
        "tenants": [{"id": f"t{i}", "api_key_env": f"BENCH_KEY_{i}"} for i in range(tenants)],
    }


def ask(http: httpx.Client, tenant: int, question: str) -> dict:
    body = {"model": "routed", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    response = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer sk-bench-{tenant}"})
    return response.raise_for_status().json()["usage"]["routing"]


def run(mode: str, args: argparse.Namespace) -> dict:
    env = {f"BENCH_KEY_{i}": f"sk-bench-{i}" for i in range(args.tenants)}
    with tempfile.TemporaryDirectory() as tmp, GatewayProcess(config(mode, args.tenants, args.upstream), Path(tmp), env) \
            as gateway, httpx.Client(base_url=gateway.base_url, timeout=300) as http:
        evaluated, compute, after_other, fresh = [], [], [], []
        for round_ in range(args.rounds):
            for question in QUESTIONS:
                for tenant in range(args.tenants):
                    routing = ask(http, tenant, f"{question} (round {round_})")
                    evaluated.append(routing["upstream_prompt_tokens"] - routing["upstream_cached_tokens"])
                    compute.append(routing["upstream_compute_ms"])
                    if tenant:  # tenant 0 asked this exact prompt just before
                        after_other.append(routing["upstream_cached_tokens"])
        for tenant in range(args.tenants):  # questions nobody asked: each tenant's own baseline
            fresh.append(ask(http, tenant, f"{QUESTIONS[tenant]} (batch {tenant})")["upstream_cached_tokens"])
    return {"evaluated": statistics.mean(evaluated), "compute": statistics.mean(compute),
            "after_other": statistics.mean(after_other), "fresh": statistics.mean(fresh), "requests": len(evaluated)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--upstream", default="qwen2.5-coder-0.5b-instruct")
    args = parser.parse_args()
    results = {mode: run(mode, args) for mode in ("shared", "tenant")}
    print("| cache_isolation | hand-offs | evaluated prompt tokens / hand-off | upstream compute ms / hand-off | "
          "cached tokens seen right after another tenant asked the same | cached tokens for a prompt nobody asked |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['requests']} | {r['evaluated']:.0f} | {r['compute']:.0f} | {r['after_other']:.0f} | "
              f"{r['fresh']:.0f} |")
    shared, tenant = results["shared"], results["tenant"]
    print(f"isolation costs {tenant['compute'] / shared['compute']:.2f}x the upstream compute per first hand-off "
          f"({tenant['evaluated'] / max(1.0, shared['evaluated']):.2f}x the evaluated prompt tokens)")


if __name__ == "__main__":
    main()
