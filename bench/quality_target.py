"""The quality target on a replayed mixed stream: does the controller settle near its target, and
what does it cost against fixed thresholds?

Run: .venv/bin/python -m bench.quality_target [--rows 50] [--fixed 1.0 3.0] [--rate 0.5]
                                              [--window 10] [--step 0.25] [--passes 2]
                                              [--humaneval PATH/HumanEval.jsonl.gz] [--out results/shadow]

The stream and the pair are bench.shadow_replay's (CommonsenseQA, GSM8K, HumanEval and IFEval dev
rows interleaved; SmolLM2-135M local, Qwen2.5-Coder-0.5B upstream in a llama-server child, tokens
mode, span 1, entropy policy). Three phases, each resumable from --out/<run>.jsonl:
1. every row through one alias per fixed entropy threshold (--fixed), and every row asked of the
   upstream directly (greedy), so each fixed configuration's true agreement with upstream-only
   answers is known;
2. the target is fixed by a rule chosen before the controlled run: the midpoint of the lowest and
   highest fixed agreements (or --target);
3. a fresh gateway whose alias starts at the cheapest fixed threshold, with shadow answers at
   --rate and `quality_target` moving `threshold` between the fixed thresholds by --step after
   every --window pooled samples; the stream is sent --passes times, and the knob's value is read
   from GET /admin/quality before each request.
Printed (and written to --out/<run>.md, with a plot of the knob and the rolling true agreement):
each fixed configuration's true agreement and routed cost per request; the controlled run's true
agreement and cost per request over its last pass (the settled part, decided before the run),
against the target and the fixed configurations.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import httpx

from adapters.upstream_server import free_port
from bench.shadow_replay import (
    KEYS,
    Records,
    ask_gateway,
    ask_upstream,
    mixed_rows,
    quality,
    stream_arguments,
    upstream_config,
)
from bench.support import SMOL, live_gateway
from policies.agreement import same_answer
from policies.online_check import wilson


def _routing(threshold: float) -> dict[str, Any]:
    return {"policy": "entropy", "threshold": threshold, "span": 1}


def gateway_config(args: argparse.Namespace, port: int, aliases: dict[str, Any]) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "queue_limit": 16},
        "models": {"local": {"smol": {"gguf": SMOL, "n_ctx": 4096, "n_threads": 1}}},
        "upstreams": {"qwen": upstream_config(args, port)},
        "aliases": {name: {"local": "smol", "upstream": "qwen", "routing": routing}
                    for name, routing in aliases.items()},
        "store": {"backend": "redis", "url": args.redis_url, "key_prefix": f"quality-target-{args.run}"},
        "tenants": [{"id": "shadowed", "api_key_env": "SHADOWED_KEY"}],
        "shadow": {"operator": "replay-operator", "refresh_s": 1.0},
        "admin_key_env": "REPLAY_ADMIN_KEY",
    }


def controlled_routing(args: argparse.Namespace, target: float) -> dict[str, Any]:
    low, high = min(args.fixed), max(args.fixed)
    return {**_routing(high), "shadow": {"rate": args.rate}, "quality_target": round(target, 4),
            "knob": {"field": "threshold", "floor": low, "ceiling": high, "step": args.step,
                     "window": args.window, "dead_band": args.dead_band}}


def fixed_phase(args: argparse.Namespace, records: Records, rows: list[dict[str, Any]]) -> None:
    todo = [(t, row) for t in args.fixed for row in rows if not records.done(f"fixed@{t}", row["id"])]
    direct = [row for row in rows if not records.done("direct", row["id"])]
    if not todo and not direct:
        return
    port = free_port()
    aliases = {f"fixed-{t}": _routing(t) for t in args.fixed}
    with live_gateway(gateway_config(args, port, aliases), args.out, env=KEYS) as gateway, \
            httpx.Client(timeout=600) as client:
        for done, (threshold, row) in enumerate(todo, 1):
            answer = ask_gateway(client, gateway.base_url, KEYS["SHADOWED_KEY"], row, args.max_tokens,
                                 model=f"fixed-{threshold}")
            records.add({"kind": f"fixed@{threshold}", "id": row["id"], "dataset": row["dataset"], **answer})
            if done % 20 == 0:
                print(f"  fixed {done}/{len(todo)}", flush=True)
        for row in direct:
            records.add({"kind": "direct", "id": row["id"], "dataset": row["dataset"],
                         **ask_upstream(client, port, row, args.max_tokens)})


def borrow_direct(records: Records, rows: list[dict[str, Any]], earlier: Records) -> None:
    """Copy `earlier`'s direct (upstream-only) answers of `rows` that `records` lacks."""
    answers = earlier.of("direct")
    for row in rows:
        if row["id"] in answers and not records.done("direct", row["id"]):
            records.add({**answers[row["id"]], "borrowed": str(earlier.path)})


def controlled_phase(args: argparse.Namespace, records: Records, rows: list[dict[str, Any]], target: float) -> None:
    stream = [(p, row) for p in range(args.passes) for row in rows]
    todo = [(p, row) for p, row in stream if not records.done(f"controlled/{p}", row["id"])]
    if not todo:
        return
    config = gateway_config(args, free_port(), {"controlled": controlled_routing(args, target)})
    with live_gateway(config, args.out, env=KEYS) as gateway, httpx.Client(timeout=600) as client:
        for done, (p, row) in enumerate(todo, 1):
            knob = quality(client, gateway.base_url)["aliases"][0]["knob"]["value"]
            answer = ask_gateway(client, gateway.base_url, KEYS["SHADOWED_KEY"], row, args.max_tokens,
                                 model="controlled")
            records.add({"kind": f"controlled/{p}", "id": row["id"], "dataset": row["dataset"], "knob": knob,
                         **answer})
            if done % 20 == 0:
                print(f"  controlled {done}/{len(todo)} (threshold {knob})", flush=True)


def agreement(records: Records, kind: str) -> tuple[int, int, float]:
    """(agreed, answers, routed cost per answer) of `kind`'s answers against the direct ones."""
    answers, direct = records.of(kind), records.of("direct")
    agreed = sum(same_answer(direct[i]["text"], answers[i]["text"]) for i in answers)
    cost = statistics.mean(r["routed_cost"] for r in answers.values()) if answers else 0.0
    return agreed, len(answers), cost


def chosen_target(args: argparse.Namespace, records: Records) -> float:
    if args.target is not None:
        return args.target
    rates = [a / n for a, n, _ in (agreement(records, f"fixed@{t}") for t in args.fixed)]
    return (min(rates) + max(rates)) / 2


def summary(args: argparse.Namespace, records: Records, target: float) -> str:
    lines = [f"# Quality target ({args.run}): {len(records.of('direct'))} rows x {args.passes} passes, "
             f"rate {args.rate}, window {args.window}, step {args.step}, dead band {args.dead_band}", "",
             f"Target: {target:.4f} (agreement with upstream-only answers).", "",
             "| configuration | answers | true agreement (95% interval) | routed cost per request "
             "| hand-offs per request |",
             "|---|---|---|---|---|"]
    for kind in [f"fixed@{t}" for t in sorted(args.fixed)] + [f"controlled/{p}" for p in range(args.passes)]:
        lines.append(_row(records, kind))
    last = records.of(f"controlled/{args.passes - 1}")
    knobs = [r["knob"] for r in last.values()]
    if knobs:
        lines += ["", f"Threshold over the last pass: mean {statistics.mean(knobs):.3f}, "
                  f"range {min(knobs)}..{max(knobs)}; moves over the whole run: {_moves(records, args)}."]
    return "\n".join(lines) + "\n"


def _row(records: Records, kind: str) -> str:
    agreed, count, cost = agreement(records, kind)
    if not count:
        return f"| {kind} | 0 | | | |"
    low, high = wilson(agreed, count)
    calls = statistics.mean(r.get("upstream_calls", 0) for r in records.of(kind).values())
    return (f"| {kind} | {count} | {agreed / count:.4f} ({low:.4f} to {high:.4f}) | ${cost:.8f} | {calls:.2f} |")


def _moves(records: Records, args: argparse.Namespace) -> int:
    knobs = [r["knob"] for p in range(args.passes) for r in records.of(f"controlled/{p}").values()]
    return sum(a != b for a, b in zip(knobs, knobs[1:]))


def plot(args: argparse.Namespace, records: Records, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    direct = records.of("direct")
    stream = [r for p in range(args.passes) for r in records.of(f"controlled/{p}").values()]
    agreed = [same_answer(direct[r["id"]]["text"], r["text"]) for r in stream]
    span = 50
    rolling = [sum(agreed[max(0, i - span + 1):i + 1]) / len(agreed[max(0, i - span + 1):i + 1]) for i in
               range(len(agreed))]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.plot([r["knob"] for r in stream], color="tab:blue")
    top.set_ylabel("entropy threshold")
    bottom.plot(rolling, color="tab:green", label=f"true agreement, last {span} requests")
    bottom.axhline(target, color="black", linestyle="--", label="target")
    bottom.set_ylabel("agreement")
    bottom.set_xlabel("request")
    bottom.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_arguments(parser, rows=50, rate=0.5, run="quality-target")
    parser.add_argument("--fixed", type=float, nargs="+", default=[1.0, 3.0], help="fixed entropy thresholds")
    parser.add_argument("--target", type=float, default=None, help="default: midpoint of the fixed agreements")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--step", type=float, default=0.25)
    parser.add_argument("--dead-band", type=float, default=0.03)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--direct-from", type=Path, default=None,
                        help="an earlier replay's records (same upstream and --max-tokens): take its direct answers")
    args = parser.parse_args()
    records = Records(args.out / f"{args.run}.jsonl")
    rows = mixed_rows(args)
    if args.direct_from is not None:
        borrow_direct(records, rows, Records(args.direct_from))
    fixed_phase(args, records, rows)
    target = chosen_target(args, records)
    print(f"target {target:.4f}", flush=True)
    controlled_phase(args, records, rows, target)
    text = summary(args, records, target)
    (args.out / f"{args.run}.md").write_text(text)
    plot(args, records, target, args.out / f"{args.run}.png")
    print(text)


if __name__ == "__main__":
    main()
