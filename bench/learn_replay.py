"""Routing that learns, on a replayed mixed stream that starts from nothing.

Run: .venv/bin/python -m bench.learn_replay [--pair reference] [--per 100] [--max-tokens 48]
                                            [--minutes 38] [--target 0.8] [--run learn] [--out results/learn]

Starts a gateway (--pair: `embedded` is SmolLM2-135M local and Qwen2.5-Coder-0.5B upstream,
`reference` Qwen2.5-Coder-0.5B local and 1.5B upstream; the upstream a llama-server child reached in
tokens mode, priced with --input-usd/--output-usd per million tokens) with one alias whose routing
learns (`routing.learn`, cold start `upstream`, a quality target of --target), two tenants taking
turns, and a Redis store under a key prefix named after --run (a resumed run keeps its examples and
its promoted check). It sends GSM8K, CommonsenseQA, MBPP and IFEval rows interleaved, from slices
nothing in this project was fitted or chosen on (GSM8K test rows 1,001-1,319, CommonsenseQA
validation rows 922-1,221, IFEval rows 201-340, MBPP's last problems), each once, greedy, answers
capped at --max-tokens.

The upstream is asked every row directly first (upstream-only's answer, cost and correctness), and
sits behind bench.greedy_cache: a greedy request asked again (a shadow sample, an escalation) gets
the upstream's first answer and its billed usage back, as a deterministic upstream would answer, so
the replay decodes each question upstream once (the records, --out/<run>-upstream.jsonl.gz, are
reused by a resumed run). With --baseline agreement, the stream's later half is sent again to an
alias with the agreement check (the `token-billed` preset's fallback: greedy answer and 3 samples,
asked afresh unless 3 of 4 agree).

Every answer is a line of --out/<run>.jsonl.gz as it comes (kind direct, routed or agreement), and
every --every rows the learning state from GET /admin/quality (kind state); rows already there are
not asked again. Stops sending after --minutes of wall time. Printed: examples learned, the promoted
versions and their held-out AUC, the chosen bar, predicted against measured agreement, and over the
later half (--later): accuracy against references and cost per correct answer, routed against
upstream-only and the agreement check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from adapters.model_files import resolve_model
from adapters.upstream_server import forgetful_args, free_port
from adapters.vocabulary import Vocabulary
from bench.greedy_cache import greedy_cache
from bench.support import SMOL, live_gateway, upstream_server
from fitting.answers import score
from fitting.datasets import DATA_DIR, Item, load_items
from fitting.tune_examples import stored_examples
from gateway.presets import FALLBACKS
from gateway.settings import StoreSettings
from policies.agreement import same_answer

KEYS = {"LEARN_A_KEY": "sk-learn-a", "LEARN_B_KEY": "sk-learn-b", "LEARN_C_KEY": "sk-learn-c",
        "LEARN_ADMIN_KEY": "sk-learn-admin"}
SLICES = {  # dataset -> (file, rows): report slices nothing was fitted or chosen on
    "gsm8k": ("gsm8k_test319_rows1001-1319.jsonl", None),
    "csqa": ("commonsenseqa_dev300_rows922-1221.jsonl", None),
    "mbpp": ("mbpp_sanitized427.jsonl", "300:"),
    "ifeval": ("ifeval_dev140_rows201-340.jsonl", None),
}


PAIRS = {  # --pair -> (local model, upstream model)
    "embedded": (SMOL, "qwen2.5-coder-0.5b-instruct"),
    "reference": ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"),
}


def gateway_config(args: argparse.Namespace, api_base: str) -> dict[str, Any]:
    local, upstream = PAIRS[args.pair]
    learn = {"min_examples": args.min_examples, "refit_every": 20, "refit_s": 5.0, "live_window": 40}
    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "queue_limit": 16},
        "models": {"local": {"local": {"gguf": local, "n_ctx": 4096, "n_threads": args.threads}}},
        "upstreams": {"up": {"model": "text-completion-openai/up", "api_base": api_base, "mode": "tokens",
                             "kind": "llama-server", "slots": 2, "template_gguf": upstream, "warm": False,
                             "retries": 0, "timeout_s": 600, "input_usd_per_mtok": args.input_usd,
                             "output_usd_per_mtok": args.output_usd}},
        "aliases": {"learn": {"local": "local", "upstream": "up", "routing": {
            "policy": "never", "shadow": {"rate": args.rate, "sampling": "greedy"},
            "quality_target": args.target, "learn": learn}},
            "agreement": {"local": "local", "upstream": "up", "routing": dict(FALLBACKS["token-billed"])}},
        "store": {"backend": "redis", "url": args.redis_url, "key_prefix": f"learn-replay-{args.run}"},
        "tenants": [{"id": "a", "api_key_env": "LEARN_A_KEY"}, {"id": "b", "api_key_env": "LEARN_B_KEY"},
                    {"id": "c", "api_key_env": "LEARN_C_KEY"}],  # c: the baseline, apart from the learning's cache
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


def ask_gateway(client: httpx.Client, base: str, key: str, item: Item, max_tokens: int,
                alias: str = "learn") -> dict[str, Any]:
    body = {"model": alias, "messages": item.messages, "max_tokens": max_tokens, "temperature": 0}
    data = client.post(f"{base}/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}).raise_for_status().json()
    routing = data["usage"]["routing"]
    return {"text": data["choices"][0]["message"]["content"], "cost": routing["upstream_cost_usd"],
            "afresh": routing.get("afresh", False), "confidence": routing.get("answer_confidence")}


def ask_upstream(client: httpx.Client, args: argparse.Namespace, api_base: str, vocab: Vocabulary,
                 item: Item) -> dict[str, Any]:
    """Upstream-only's answer, asked as the gateway asks an escalation in tokens mode (the same ids of
    the upstream's own template, so the greedy records answer both alike)."""
    ids = vocab.prompt_ids(vocab.template.render_parts(item.messages, False))
    body = {"model": "up", "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0.0, "top_p": 1.0}
    data = client.post(f"{api_base}/completions", json=body).raise_for_status().json()
    usage = data["usage"]
    cost = (usage["prompt_tokens"] * args.input_usd + usage["completion_tokens"] * args.output_usd) / 1e6
    return {"text": data["choices"][0]["text"], "cost": cost}


def learning(client: httpx.Client, base: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEYS['LEARN_ADMIN_KEY']}"}
    report = client.get(f"{base}/admin/quality?minutes=1440", headers=headers).raise_for_status().json()
    return report["aliases"][0]


def ask_directly(args: argparse.Namespace, records: Records, rows: list[tuple[str, Item]], api_base: str,
                 client: httpx.Client) -> None:
    """Upstream-only's answer to every row, two at a time (the upstream's two slots)."""
    todo = [(index, dataset, item) for index, (dataset, item) in enumerate(rows)
            if ("direct", f"{dataset}/{item.id}") not in records.seen]

    vocab = Vocabulary(resolve_model(PAIRS[args.pair][1]))

    def one(task: tuple[int, str, Item]) -> dict[str, Any]:
        index, dataset, item = task
        got = ask_upstream(client, args, api_base, vocab, item)
        return {"kind": "direct", "id": f"{dataset}/{item.id}", "index": index, "dataset": dataset,
                "correct": correct(dataset, item, got["text"]), **got}

    with ThreadPoolExecutor(2) as pool:
        for done, record in enumerate(pool.map(one, todo), 1):
            records.add(record)
            if done % 20 == 0:
                print(f"  upstream-only: {done}/{len(todo)} rows asked", flush=True)


def replay(args: argparse.Namespace, records: Records, rows: list[tuple[str, Item]], base: str,
           client: httpx.Client, deadline: float) -> None:
    """The stream, in order, through the learning alias (two tenants taking turns)."""
    for index, (dataset, item) in enumerate(rows):
        if time.monotonic() > deadline:
            print(f"  wall limit of {args.minutes} min reached at row {index}", flush=True)
            return
        row_id = f"{dataset}/{item.id}"
        if ("routed", row_id) not in records.seen:
            key = KEYS["LEARN_A_KEY"] if index % 2 == 0 else KEYS["LEARN_B_KEY"]
            got = ask_gateway(client, base, key, item, args.max_tokens)
            records.add({"kind": "routed", "id": row_id, "index": index, "dataset": dataset,
                         "correct": correct(dataset, item, got["text"]), "t": round(time.time(), 1), **got})
        if index % args.every == args.every - 1:
            entry = learning(client, base)
            records.add({"kind": "state", "id": f"state/{index}", "index": index, "figures": entry["figures"],
                         "learning": entry["learning"]})
            state = entry["learning"]
            print(f"  row {index + 1}/{len(rows)}: {state['examples']} examples, {state['state']}, version "
                  f"{state['version']}, held-out AUC {state['held_out_auc']}, bar {(state['bar'] or {}).get('value')}",
                  flush=True)


def baseline(args: argparse.Namespace, records: Records, rows: list[tuple[str, Item]], later: int, base: str,
             client: httpx.Client, deadline: float) -> None:
    """The stream's later half (from row `later`) through the agreement-check alias (nothing learned there)."""
    for index in range(later, len(rows)):
        dataset, item = rows[index]
        row_id = f"{dataset}/{item.id}"
        if ("agreement", row_id) in records.seen:
            continue
        if time.monotonic() > deadline:
            print(f"  wall limit of {args.minutes} min reached at row {index} of the agreement check", flush=True)
            return
        got = ask_gateway(client, base, KEYS["LEARN_C_KEY"], item, args.max_tokens, alias="agreement")
        records.add({"kind": "agreement", "id": row_id, "index": index, "dataset": dataset,
                     "correct": correct(dataset, item, got["text"]), **got})


def summary(args: argparse.Namespace, records: Records, final: dict[str, Any] | None, labels: list[bool],
            later: int) -> str:
    """The run's report: the learning state and fits, then the table of the rows from `later` on."""
    routed = {r["id"]: r for r in records.of("routed")}
    lines = [f"# Learning replay ({args.run}, {args.pair} pair): {len(routed)} requests, target {args.target}, "
             f"max_tokens {args.max_tokens}", ""]
    state = (final or {}).get("learning") or (records.of("state")[-1]["learning"] if records.of("state") else {})
    lines += [f"- examples learned: {state.get('examples')} (learning since {state.get('learning_since')}); "
              f"state {state.get('state')}, version {state.get('version')}, bar {state.get('bar')}",
              f"- predicted agreement {state.get('predicted_agreement')} (escalated share "
              f"{state.get('predicted_escalated_share')}); measured while it routed: {state.get('measured')}",
              f"- examples whose local answer agreed with upstream-only's: {sum(labels)}/{len(labels)}", "",
              "| fit | examples | fitted on | held out | held-out AUC | current AUC | bar | promoted |",
              "|---|---|---|---|---|---|---|---|"]
    for fit in state.get("fits", []):
        lines.append(f"| v{fit.get('version')} {fit.get('event', '')} | {fit.get('examples')} | {fit.get('fitted_on')} "
                     f"| {fit.get('held_out')} | {fit.get('auc', fit.get('live_auc'))} | {fit.get('current_auc')} "
                     f"| {fit.get('bar')} | {fit.get('promoted')} |")
    columns = {"routed (learning)": routed, "agreement check": {r["id"]: r for r in records.of("agreement")},
               "upstream-only": {r["id"]: r for r in records.of("direct")}}
    rows = [i for i, r in routed.items() if r["index"] >= later and all(i in c for c in columns.values())]
    lines += ["", *_later_half(columns, rows, labels)]
    return "\n".join(lines) + "\n"


def _later_half(columns: dict[str, dict[str, Any]], rows: list[str], labels: list[bool]) -> list[str]:
    if not rows:
        return ["no row of the later half has all its answers yet"]
    direct = columns["upstream-only"]
    scored = [i for i in rows if all(c[i]["correct"] is not None for c in columns.values())]
    right = {name: sum(c[i]["correct"] for i in scored) for name, c in columns.items()}
    cost = {name: sum(c[i]["cost"] for i in rows) for name, c in columns.items()}
    per = {name: cost[name] / right[name] if right[name] else None for name in columns}

    def cells(value: Any) -> str:
        return " | ".join(value(name, c) for name, c in columns.items())

    lines = [f"Later half: {len(rows)} rows ({len(scored)} scored against references)", "",
             f"| | {' | '.join(columns)} |", "|---|" + "---|" * len(columns),
             "| accuracy | " + cells(lambda n, c: f"{right[n]}/{len(scored)} = {right[n] / max(1, len(scored)):.3f}")
             + " |",
             "| upstream cost | " + cells(lambda n, c: f"${cost[n]:.6f} ({cost[n] / cost['upstream-only']:.3f}x)")
             + " |",
             "| cost per correct answer | " + cells(lambda n, c: f"${per[n]:.8f} ({per[n] / per['upstream-only']:.3f}x)"
                                                     if per[n] and per["upstream-only"] else "-") + " |",
             "| agreement with upstream-only | " + cells(
                 lambda n, c: f"{sum(same_answer(direct[i]['text'], c[i]['text']) for i in rows)}/{len(rows)}") + " |",
             "| asked afresh | " + cells(lambda n, c: f"{sum(bool(c[i].get('afresh')) for i in rows)}/{len(rows)}"
                                        if n != "upstream-only" else "-") + " |"]
    for dataset in sorted({direct[i]["dataset"] for i in rows}):
        part = [i for i in scored if direct[i]["dataset"] == dataset]
        if part:
            lines.append(f"| accuracy, {dataset} | " + cells(
                lambda n, c: f"{sum(c[i]['correct'] for i in part)}/{len(part)}") + " |")
    if labels:
        floor = 1 - sum(labels) / len(labels)
        lines += ["", f"A perfect check (asks afresh exactly the local answers that disagree) would ask "
                      f"{floor:.3f} of the answers: about {floor:.2f}x upstream-only's cost at its accuracy, "
                      f"by the share of the alias's examples that disagreed."]
    return lines


def example_labels(args: argparse.Namespace, state: dict[str, Any]) -> list[bool]:
    """Whether each example the gateway kept agreed (its label), read from the Store."""
    store = StoreSettings(backend="redis", url=args.redis_url, key_prefix=f"learn-replay-{args.run}")
    return [example.agreed for example in asyncio.run(stored_examples(store, state["key"]))]


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


def arguments() -> argparse.Namespace:
    """The replay's command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="embedded", help="local and upstream models")
    parser.add_argument("--per", type=int, default=100, help="rows of each dataset")
    parser.add_argument("--threads", type=int, default=2, help="threads of the local model and of the upstream")
    parser.add_argument("--baseline", choices=["agreement", "none"], default="agreement",
                        help="send the later half again to the agreement check")
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
    later = int(len(rows) * (1 - args.later))
    proxy = free_port()
    api_base = f"http://127.0.0.1:{proxy}/v1"
    deadline = time.monotonic() + args.minutes * 60
    upstream_gguf = resolve_model(PAIRS[args.pair][1], fetch=True)
    # forgetful: the gateway isolates three tenants' prefix caches on two slots by erasing them
    with upstream_server(upstream_gguf, "up", server="llama-server", extra_args=tuple(forgetful_args()),
                         n_threads=args.threads, n_ctx=4096) as served, \
            greedy_cache(served.removesuffix("/v1"), args.out / f"{args.run}-upstream.jsonl.gz", proxy) as answers, \
            httpx.Client(timeout=900) as client:
        ask_directly(args, records, rows, api_base, client)
        with live_gateway(gateway_config(args, api_base), args.out, env=KEYS) as gateway:
            replay(args, records, rows, gateway.base_url, client, deadline)
            time.sleep(8)  # the last shadow samples and fit
            final = learning(client, gateway.base_url)
            if args.baseline == "agreement":
                baseline(args, records, rows, later, gateway.base_url, client, deadline)
        print(f"  upstream answers recorded: {answers.misses} asked, {answers.hits} answered from the records",
              flush=True)
    text = summary(args, records, final, example_labels(args, final["learning"]), later)
    (args.out / f"{args.run}.md").write_text(text)
    (args.out / f"{args.run}-quality.json").write_text(json.dumps(final, indent=1))
    plot(records, args.out / f"{args.run}.png")
    print(text)


if __name__ == "__main__":
    main()
