"""Routing that learns, on a replayed mixed stream that starts from nothing.

Run: .venv/bin/python -m bench.learn_replay [--per 100] [--max-tokens 48] [--minutes 38]
                                            [--target 0.8] [--run learn] [--out results/learn]

Starts a gateway (SmolLM2-135M local; Qwen2.5-Coder-0.5B in a llama-server child as the upstream,
tokens mode, priced with --input-usd/--output-usd per million tokens) with one alias whose routing
learns (`routing.learn`, cold start `upstream`, a quality target of --target), two tenants taking
turns, and a Redis store under a key prefix named after --run (a resumed run keeps its examples and
its promoted check). It sends GSM8K, CommonsenseQA, MBPP and IFEval rows interleaved, from slices
nothing in this project was fitted or chosen on (GSM8K test rows 1,001-1,319, CommonsenseQA
validation rows 922-1,221, IFEval rows 201-340, MBPP's last problems), each once, greedy, answers
capped at --max-tokens. For every row of the stream's later half (--later) it also asks the upstream
directly: upstream-only's answer, cost and correctness on the same rows.

Every answer is a line of --out/<run>.jsonl.gz as it comes (kind routed or direct), and every
--every rows the learning state from GET /admin/quality (kind state); rows already there are not
asked again. Stops sending after --minutes of wall time. Printed: examples learned, the promoted
versions and their held-out AUC, the chosen bar, predicted against measured agreement, and over the
later half: accuracy against references and cost per correct answer, routed against upstream-only.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import time
from pathlib import Path
from typing import Any

import httpx

from adapters.upstream_server import free_port
from bench.shadow_replay import upstream_config
from bench.support import SMOL, live_gateway
from fitting.answers import score
from fitting.datasets import DATA_DIR, Item, load_items
from policies.agreement import same_answer

KEYS = {"LEARN_A_KEY": "sk-learn-a", "LEARN_B_KEY": "sk-learn-b", "LEARN_ADMIN_KEY": "sk-learn-admin"}
SLICES = {  # dataset -> (file, rows): report slices nothing was fitted or chosen on
    "gsm8k": ("gsm8k_test319_rows1001-1319.jsonl", None),
    "csqa": ("commonsenseqa_dev300_rows922-1221.jsonl", None),
    "mbpp": ("mbpp_sanitized427.jsonl", "300:"),
    "ifeval": ("ifeval_dev140_rows201-340.jsonl", None),
}


def gateway_config(args: argparse.Namespace, upstream_port: int) -> dict[str, Any]:
    learn = {"min_examples": args.min_examples, "refit_every": 20, "refit_s": 5.0, "live_window": 40}
    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "queue_limit": 16},
        "models": {"local": {"smol": {"gguf": SMOL, "n_ctx": 4096, "n_threads": 1}}},
        "upstreams": {"qwen": upstream_config(args, upstream_port)},
        "aliases": {"learn": {"local": "smol", "upstream": "qwen", "routing": {
            "policy": "never", "shadow": {"rate": args.rate, "sampling": "greedy"},
            "quality_target": args.target, "learn": learn}}},
        "store": {"backend": "redis", "url": args.redis_url, "key_prefix": f"learn-replay-{args.run}"},
        "tenants": [{"id": "a", "api_key_env": "LEARN_A_KEY"}, {"id": "b", "api_key_env": "LEARN_B_KEY"}],
        "shadow": {"operator": "learn-operator", "refresh_s": 2.0, "queue": 32},
        "admin_key_env": "LEARN_ADMIN_KEY",
    }


def stream(args: argparse.Namespace) -> list[tuple[str, Item]]:
    """`--per` rows of each slice, interleaved."""
    per = {name: load_items(name, args.data_dir / file, rows)[:args.per] for name, (file, rows) in SLICES.items()}
    return [(name, items[i]) for i in range(args.per) for name, items in per.items() if i < len(items)]


class Records:
    """The gzipped JSONL of the run so far (one gzip member per line: a killed run loses one line at most)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        if path.exists():
            with gzip.open(path, "rt") as handle, contextlib.suppress(EOFError, json.JSONDecodeError):
                for line in handle:  # a line cut short by a kill ends the reading: the lines before it stand
                    self.rows.append(json.loads(line))
        self.seen = {(r["kind"], r.get("id")) for r in self.rows}

    def add(self, record: dict[str, Any]) -> None:
        self.rows.append(record)
        self.seen.add((record["kind"], record.get("id")))
        with gzip.open(self.path, "at") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["kind"] == kind]


def correct(dataset: str, item: Item, text: str) -> bool | None:
    try:
        return bool(score(dataset, item, text).correct)
    except Exception:  # noqa: BLE001 - a scorer whose package is missing (IFEval's): unscored
        return None


def ask_gateway(client: httpx.Client, base: str, key: str, item: Item, max_tokens: int) -> dict[str, Any]:
    body = {"model": "learn", "messages": item.messages, "max_tokens": max_tokens, "temperature": 0}
    data = client.post(f"{base}/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}).raise_for_status().json()
    routing = data["usage"]["routing"]
    return {"text": data["choices"][0]["message"]["content"], "cost": routing["upstream_cost_usd"],
            "afresh": routing.get("afresh", False), "confidence": routing.get("answer_confidence")}


def ask_upstream(client: httpx.Client, args: argparse.Namespace, port: int, item: Item) -> dict[str, Any]:
    body = {"messages": item.messages, "max_tokens": args.max_tokens, "temperature": 0, "repeat_penalty": 1.0}
    data = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body).raise_for_status().json()
    usage = data["usage"]
    cost = (usage["prompt_tokens"] * args.input_usd + usage["completion_tokens"] * args.output_usd) / 1e6
    return {"text": data["choices"][0]["message"]["content"], "cost": cost}


def learning(client: httpx.Client, base: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEYS['LEARN_ADMIN_KEY']}"}
    report = client.get(f"{base}/admin/quality?minutes=1440", headers=headers).raise_for_status().json()
    return report["aliases"][0]


def replay(args: argparse.Namespace, records: Records, rows: list[tuple[str, Item]], base: str, port: int,
           client: httpx.Client) -> None:
    started = time.monotonic()
    later = int(len(rows) * (1 - args.later))
    for index, (dataset, item) in enumerate(rows):
        if time.monotonic() - started > args.minutes * 60:
            print(f"  wall limit of {args.minutes} min reached at row {index}", flush=True)
            return
        row_id = f"{dataset}/{item.id}"
        if ("routed", row_id) not in records.seen:
            key = KEYS["LEARN_A_KEY"] if index % 2 == 0 else KEYS["LEARN_B_KEY"]
            got = ask_gateway(client, base, key, item, args.max_tokens)
            records.add({"kind": "routed", "id": row_id, "index": index, "dataset": dataset,
                         "correct": correct(dataset, item, got["text"]), "t": round(time.time(), 1), **got})
        if index >= later and ("direct", row_id) not in records.seen:
            got = ask_upstream(client, args, port, item)
            records.add({"kind": "direct", "id": row_id, "index": index, "dataset": dataset,
                         "correct": correct(dataset, item, got["text"]), **got})
        if index % args.every == args.every - 1:
            entry = learning(client, base)
            records.add({"kind": "state", "id": f"state/{index}", "index": index, "figures": entry["figures"],
                         "learning": entry["learning"]})
            state = entry["learning"]
            print(f"  row {index + 1}/{len(rows)}: {state['examples']} examples, {state['state']}, version "
                  f"{state['version']}, held-out AUC {state['held_out_auc']}, bar {(state['bar'] or {}).get('value')}",
                  flush=True)


def summary(args: argparse.Namespace, records: Records, final: dict[str, Any] | None) -> str:
    routed = {r["id"]: r for r in records.of("routed")}
    direct = {r["id"]: r for r in records.of("direct")}
    both = [i for i in direct if i in routed]
    lines = [f"# Learning replay ({args.run}): {len(routed)} requests, target {args.target}, "
             f"max_tokens {args.max_tokens}", ""]
    state = (final or {}).get("learning") or (records.of("state")[-1]["learning"] if records.of("state") else {})
    lines += [f"- examples learned: {state.get('examples')} (learning since {state.get('learning_since')}); "
              f"state {state.get('state')}, version {state.get('version')}, bar {state.get('bar')}",
              f"- predicted agreement {state.get('predicted_agreement')} (escalated share "
              f"{state.get('predicted_escalated_share')}); measured while it routed: {state.get('measured')}", "",
              "| fit | examples | fitted on | held out | held-out AUC | current AUC | bar | promoted |",
              "|---|---|---|---|---|---|---|---|"]
    for fit in state.get("fits", []):
        lines.append(f"| v{fit.get('version')} {fit.get('event', '')} | {fit.get('examples')} | {fit.get('fitted_on')} "
                     f"| {fit.get('held_out')} | {fit.get('auc', fit.get('live_auc'))} | {fit.get('current_auc')} "
                     f"| {fit.get('bar')} | {fit.get('promoted')} |")
    lines += ["", *_later_half(routed, direct, both)]
    return "\n".join(lines) + "\n"


def _later_half(routed: dict[str, Any], direct: dict[str, Any], both: list[str]) -> list[str]:
    if not both:
        return ["no row of the later half has its upstream-only answer yet"]
    scored = [i for i in both if routed[i]["correct"] is not None and direct[i]["correct"] is not None]
    r_right, d_right = sum(routed[i]["correct"] for i in scored), sum(direct[i]["correct"] for i in scored)
    r_cost, d_cost = sum(routed[i]["cost"] for i in both), sum(direct[i]["cost"] for i in both)
    agree = sum(same_answer(direct[i]["text"], routed[i]["text"]) for i in both)
    afresh = sum(bool(routed[i]["afresh"]) for i in both)
    lines = [f"Later half: {len(both)} rows ({len(scored)} scored against references)", "",
             "| | routed (learning) | upstream-only |", "|---|---|---|",
             f"| accuracy | {r_right}/{len(scored)} = {r_right / max(1, len(scored)):.3f} | "
             f"{d_right}/{len(scored)} = {d_right / max(1, len(scored)):.3f} |",
             f"| upstream cost | ${r_cost:.6f} ({r_cost / d_cost if d_cost else float('nan'):.3f}x) | ${d_cost:.6f} |",
             f"| cost per correct answer | {_per(r_cost, r_right)} | {_per(d_cost, d_right)} |",
             f"| agreement with upstream-only | {agree}/{len(both)} = {agree / len(both):.3f} | 1 |",
             f"| asked afresh | {afresh}/{len(both)} | - |"]
    for dataset in sorted({routed[i]["dataset"] for i in both}):
        part = [i for i in scored if routed[i]["dataset"] == dataset]
        if part:
            lines.append(f"| accuracy, {dataset} | {sum(routed[i]['correct'] for i in part)}/{len(part)} | "
                         f"{sum(direct[i]['correct'] for i in part)}/{len(part)} |")
    return lines


def plot(records: Records, path: Path) -> None:
    """The learning curve: per row, the rolling share asked afresh, and at each state record the
    held-out AUC of the promoted check and its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routed = sorted(records.of("routed"), key=lambda r: r["index"])
    window = 20
    afresh = [sum(bool(r["afresh"]) for r in routed[max(0, i - window + 1):i + 1]) / min(i + 1, window)
              for i in range(len(routed))]
    first: dict[int, dict[str, Any]] = {}
    for record in records.of("state"):  # a resumed run records its skipped rows' states again: the first stands
        first.setdefault(record["index"], record["learning"])
    states = sorted(first.items())
    figure, axis = plt.subplots(figsize=(8, 3.5))
    axis.plot([r["index"] for r in routed], afresh, label=f"share asked afresh (last {window})")
    axis.plot([i for i, s in states], [s["held_out_auc"] if s["version"] else None for i, s in states], "o-",
              label="promoted check's held-out AUC")
    axis.plot([i for i, s in states], [s["bar"]["value"] if s["version"] and s["bar"] else None for i, s in states],
              "s--", label="escalate_below")
    axis.plot([i for i, s in states], [s["examples"] / max(1, states[-1][1]["examples"]) for i, s in states], ":",
              label="examples (share of the last count)")
    axis.set_xlabel("request")
    axis.set_ylim(0, 1.05)
    axis.legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _per(cost: float, right: int) -> str:
    return f"${cost / right:.8f}" if right else "-"


def arguments() -> argparse.Namespace:
    """The replay's command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per", type=int, default=100, help="rows of each dataset")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--minutes", type=float, default=38.0, help="stop sending after this much wall time")
    parser.add_argument("--target", type=float, default=0.8, help="the alias's quality_target")
    parser.add_argument("--rate", type=float, default=0.25, help="shadow rate once a check is promoted")
    parser.add_argument("--min-examples", type=int, default=60)
    parser.add_argument("--later", type=float, default=0.5, help="share of the stream at its end measured")
    parser.add_argument("--every", type=int, default=10, help="rows between learning-state records")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--out", type=Path, default=Path("results/learn"))
    parser.add_argument("--run", default="learn")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--input-usd", type=float, default=0.27, help="upstream price per million prompt tokens")
    parser.add_argument("--output-usd", type=float, default=1.10, help="... per million completion tokens")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    records = Records(args.out / f"{args.run}.jsonl.gz")
    rows = stream(args)
    port = free_port()
    final = None
    with live_gateway(gateway_config(args, port), args.out, env=KEYS) as gateway, \
            httpx.Client(timeout=600) as client:
        replay(args, records, rows, gateway.base_url, port, client)
        time.sleep(8)  # the last shadow samples and fit
        final = learning(client, gateway.base_url)
    text = summary(args, records, final)
    (args.out / f"{args.run}.md").write_text(text)
    (args.out / f"{args.run}-quality.json").write_text(json.dumps(final, indent=1))
    plot(records, args.out / f"{args.run}.png")
    print(text)


if __name__ == "__main__":
    main()
