"""Issue #63's combine study, in FS-GEN's shape: accuracy against the routed share for take,
contrastive and fuse at the routed steps, on held-out CommonsenseQA or GSM8K (`--dataset`; `--dev`
for the dev rows parameters are chosen on), the embedded pair unless --local and --upstream name
another (`top1@1` routes every step, FS-GEN's 100% point).

    .venv/bin/python -m eval.studies.combine.combine_study run --rows 100:200 --configs entropy@2.5
    .venv/bin/python -m eval.studies.combine.combine_study report --rows 100:200 --configs entropy@2.5
    .venv/bin/python -m eval.studies.combine.combine_study run --dev --rows 0:50 --configs entropy@2.0 \
        --rules take contrastive:beta=0.25 contrastive:beta=1 fuse:weight=0.7

`run` decodes item by item: `local` and `upstream` (the large model asked directly) through the
eval harness's own runner (fitting/runner.py), then each routing config once per combine rule
(`--rules`: a rule's name, or its name with parameters) with the real decoder (one llama-server,
tokens mode, as `python -m eval run` launches it), a fresh unlimited gate per answer (no
continuation cache shared between rules). Records are written as `python -m eval run` writes them,
<out>/<dataset>__<config>.jsonl and combined/<dataset>__<config>+<rule>.jsonl, resumable (an item
already recorded is skipped); gzip them once done.

`report`: accuracy per config and rule over the items every config answered, the routed share of
answer tokens, and each rule paired with take at the same routing config (gained / lost, exact
McNemar p, paired bootstrap interval of the accuracy difference), with how its routed steps chose
(usage.routing.combined). `plot`: the same records as accuracy against the routed share, a line per rule.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from adapters.memory_store import MemoryStore
from adapters.store import Limits
from fitting.answers import score
from fitting.configs import parse_config
from fitting.datasets import MAX_TOKENS, Item, load_items
from fitting.records import append_record, read_records, records_path
from fitting.runner import RunPlan, run
from fitting.summary import bootstrap_ci, mcnemar_p
from fitting.session import Models, ModelOptions, open_models
from gateway.decoding.cost_ceiling import CostCeiling
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.decoding.values import RequestRouting
from gateway.settings.routing_values import CeilingRule, CombineRule, HandoffRule
from gateway.tenancy.budget import HandoffGate, Ledger

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "results" / "combine"
DATA = {  # dataset -> (held-out rows nothing was fitted or chosen on, dev rows parameters are chosen on)
    "csqa": ("commonsenseqa_dev300_rows922-1221.jsonl", "commonsenseqa_dev300.jsonl"),
    "gsm8k": ("gsm8k_test319_rows1001-1319.jsonl", "gsm8k_dev300.jsonl"),
}
RULES = ("take", "contrastive", "fuse")
PARAMETERS = {"alpha": "combine_alpha", "beta": "combine_beta", "weight": "combine_weight",
              "alternatives": "combine_alternatives"}


def combine_rule(name: str) -> CombineRule:
    """A rule as the study names it: `contrastive` (its defaults) or `contrastive:beta=1,alpha=0.05`."""
    rule, _, given = name.partition(":")
    values = dict(pair.split("=") for pair in given.split(",")) if given else {}
    return CombineRule(rule, **{PARAMETERS[k]: float(v) if k != "alternatives" else int(v) for k, v in values.items()})


def data_path(args: argparse.Namespace) -> Path:
    """The rows' file: `--data` where given, else the dataset's held-out (or with --dev, dev) file."""
    return ROOT / "data" / (args.data or DATA[args.dataset][args.dev])


async def decode(models: Models, dataset: str, item: Item, config: str, rule: str, max_tokens: int) -> dict[str, Any]:
    """One answer under routing `config` with combine `rule` (`combine_rule`), as a record."""
    spec = parse_config(config)
    routing = RequestRouting(spec.policy_object(models.router), HandoffRule(1),
                             CostCeiling(CeilingRule(), models.upstream.prices, 0), combine=combine_rule(rule))
    gate = HandoffGate(Ledger(MemoryStore()), "eval", Limits(), allowed=True)
    decoding = Decoding(models.local, models.upstream, gate,
                        DecodeRequest(messages=item.messages, max_tokens=max_tokens, routing=routing))
    started = time.monotonic()
    async for _ in decoding.pieces():
        pass
    text, usage, counts = decoding.text.text, decoding.usage, decoding.source_counts()
    scored = score(dataset, item, text)
    return {"id": item.id, "row": item.row, "config": f"{config}+{rule}", "dataset": dataset, "gold": item.gold,
            "text": text, "pred": scored.pred, "correct": scored.correct, "answer_tokens": len(decoding.answer_tokens),
            "upstream_tokens": counts["upstream"] + counts["cache"], "upstream_calls": usage.upstream_calls,
            "upstream_cost_usd": usage.upstream_cost_usd, "combined": dict(usage.combined),
            "degraded": list(usage.degraded), "wall_s": round(time.monotonic() - started, 3)}


async def run_study(args: argparse.Namespace) -> None:
    items = load_items(args.dataset, data_path(args), args.rows)
    models = await open_models(ModelOptions(local=args.local, upstream=args.upstream, threads=args.threads,
                                            router=args.router), with_upstream=True)
    deadline = time.monotonic() + args.minutes * 60
    try:
        for item in items:
            if time.monotonic() > deadline:
                print("time is up: rerun the same command to resume", flush=True)
                break
            await run(RunPlan(args.dataset, [item], [parse_config("local"), parse_config("upstream")], args.out,
                              args.max_tokens), models)
            for config in args.configs:
                for rule in args.rules:
                    path = records_path(args.out / "combined", args.dataset, f"{config}+{rule}")
                    if any(r["id"] == item.id for r in read_records(path)):
                        continue
                    append_record(path, await decode(models, args.dataset, item, config, rule, args.max_tokens))
            print(f"item {item.row} done", flush=True)
    finally:
        models.close()


def answered(args: argparse.Namespace) -> tuple[list[str], dict[str, dict[str, dict[str, Any]]], list[str]]:
    """The configs' names (local, upstream, then each config under each rule), their records by item
    id, and the items every one of them answered."""
    wanted = {item.id for item in load_items(args.dataset, data_path(args), args.rows)}
    names = ["local", "upstream"] + [f"{c}+{r}" for c in args.configs for r in args.rules]
    records = {name: {r["id"]: r for r in read_records(records_path(args.out / ("combined" if "+" in name else ""),
                                                                    args.dataset, name)) if r["id"] in wanted}
               for name in names}
    return names, records, sorted(set.intersection(*(set(by_id) for by_id in records.values())))


def accuracy(by_id: dict[str, dict[str, Any]], common: list[str]) -> float:
    return sum(by_id[i]["correct"] for i in common) / max(1, len(common))


def routed_share(by_id: dict[str, dict[str, Any]], common: list[str]) -> float:
    """Answer tokens the upstream wrote (or a routed step combined), of all written."""
    written = sum(by_id[i]["answer_tokens"] for i in common)
    return sum(by_id[i]["upstream_tokens"] for i in common) / max(1, written)


def report(args: argparse.Namespace) -> None:
    names, records, common = answered(args)
    n = len(common)
    print(f"{n} {'dev' if args.dev else 'held-out'} {args.dataset} items answered by every config (rows {args.rows}); "
          f"max_tokens {args.max_tokens}\n")
    print("| config | accuracy | routed share of tokens | vs take: gained / lost (McNemar p; paired bootstrap 95% "
          "interval of the difference) | routed steps: "
          "agreed / changed / fell back | upstream calls, cost |")
    print("|---|---|---|---|---|---|")
    for name in names:
        by_id = records[name]
        right = sum(by_id[i]["correct"] for i in common)
        paired, steps = "", ""
        if "+" in name and not name.endswith("+take"):
            take = records.get(name.rsplit("+", 1)[0] + "+take")
            if take is None:
                raise SystemExit(f"{name} is paired with take at the same config: add take to --rules")
            gained = sum(by_id[i]["correct"] and not take[i]["correct"] for i in common)
            lost = sum(take[i]["correct"] and not by_id[i]["correct"] for i in common)
            low, high = bootstrap_ci([float(by_id[i]["correct"]) - float(take[i]["correct"]) for i in common])
            paired = f"{gained} / {lost} (p = {mcnemar_p(gained, lost):.2f}; {low:+.1%} to {high:+.1%})"
            how = {k: sum(by_id[i]["combined"].get(k, 0) for i in common) for k in ("agreed", "changed", "fell_back")}
            steps = f"{how['agreed']} / {how['changed']} / {how['fell_back']}"
        calls = sum(by_id[i]["upstream_calls"] for i in common)
        cost = sum(by_id[i]["upstream_cost_usd"] for i in common)
        print(f"| {name} | {right / max(1, n):.1%} ({right}/{n}) | {routed_share(by_id, common):.1%} | {paired} | "
              f"{steps} | {calls}, ${cost:.4f} |")


def plot(args: argparse.Namespace) -> None:
    """FS-GEN's figure: accuracy against the routed share, one line per rule from local alone (0%)
    through each config, the upstream asked directly as a dashed level; to <out>/<dataset>-curve.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, records, common = answered(args)
    figure, axis = plt.subplots(figsize=(6, 4))
    local = accuracy(records["local"], common)
    for rule in args.rules:
        points = sorted((routed_share(records[f"{c}+{rule}"], common), accuracy(records[f"{c}+{rule}"], common))
                        for c in args.configs)
        axis.plot([0.0] + [x for x, _ in points], [local] + [y for _, y in points], "o-", label=rule)
    axis.axhline(accuracy(records["upstream"], common), linestyle="--", color="grey", label="upstream asked directly")
    axis.set_xlabel("routed share of answer tokens")
    axis.set_ylabel("accuracy")
    axis.set_title(f"{args.dataset}, {len(common)} {'dev' if args.dev else 'held-out'} items (rows {args.rows})",
                   fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.out / f"{args.dataset}-curve.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "report", "plot"])
    parser.add_argument("--rows", default="100:200")
    parser.add_argument("--configs", nargs="+", default=["entropy@2.5"])
    parser.add_argument("--rules", nargs="+", default=list(RULES),
                        help="combine rules, each NAME or NAME:alpha=A,beta=B,weight=W,alternatives=K")
    parser.add_argument("--dataset", choices=sorted(DATA), default="csqa")
    parser.add_argument("--dev", action="store_true", help="the dataset's dev rows (to choose parameters on), "
                        "not its held-out slice")
    parser.add_argument("--data", help="another file of the dataset's under data/ whose --rows nothing was "
                        "fitted or chosen on (GSM8K: gsm8k_dev300.jsonl rows 200-299, where earlier runs' local "
                        "and upstream records can be borrowed)")
    parser.add_argument("--router", help="a learned router file, for learned@S configs")
    parser.add_argument("--local", default="smollm2-135m-instruct")
    parser.add_argument("--upstream", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=18.0, help="run: stop starting items after this long")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--max-tokens", type=int, help="the answer's cap (default: the dataset's in the "
                        "eval harness, 32 for CommonsenseQA)")
    args = parser.parse_args()
    args.max_tokens = args.max_tokens or MAX_TOKENS[args.dataset]
    if args.command == "run":
        asyncio.run(run_study(args))
    else:
        {"report": report, "plot": plot}[args.command](args)


if __name__ == "__main__":
    main()
