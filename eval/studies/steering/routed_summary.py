"""Routing on a steered model: CommonsenseQA rows 922-1,221 routed by the plain model's router, plain
against steered (eval/studies/steering/routed.sh), beside local-only and upstream-only.

    .venv/bin/python -m eval.studies.steering.routed_summary

Per config: accuracy, gained / lost against the plain local model (McNemar p), calls and upstream
tokens per question, and cost per correct answer as a multiple of upstream-only's on each token
sheet (fitting/costs.py); then each routed config steered against the same config plain, paired.
"""

from __future__ import annotations

from pathlib import Path

from fitting.costs import SHEETS_BY_NAME, repriced_table
from fitting.records import RUNS_DIR, read_records
from fitting.summary import bootstrap_ci, mcnemar_p

RUNS = Path(__file__).resolve().parents[3] / "results" / "steering" / "runs"
UPSTREAM = RUNS_DIR / "agreement_csqa_report" / "csqa__upstream.jsonl"
ROUTED = ("learned@0.05", "learned@0.05,from=traffic")


def records(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_records(path)}  # its own, gzipped or borrowed (fitting/records.py)


def main() -> None:
    configs = {"upstream": records(UPSTREAM)}
    for model in ("plain", "s0.25"):
        for config in ("local", *ROUTED):
            configs[f"{model} {config}"] = records(RUNS / f"csqa_routed_{model}" / f"csqa__{config}.jsonl")
    ids = sorted(set.intersection(*(set(c) for c in configs.values())))
    base = configs["plain local"]
    print(f"{len(ids)} questions\n\n| config | gained / lost vs plain local (p) | calls / q | upstream tokens / q |")
    print("|---|---|---|---|")
    for name, config in configs.items():
        gained = sum(config[i]["correct"] and not base[i]["correct"] for i in ids)
        lost = sum(base[i]["correct"] and not config[i]["correct"] for i in ids)
        calls = sum(config[i]["upstream_calls"] for i in ids) / len(ids)
        written = sum(config[i]["upstream_tokens"] for i in ids) / len(ids)
        print(f"| {name} | {gained} / {lost} ({mcnemar_p(gained, lost):.2g}) | {calls:.2f} | {written:.1f} |")
    sheets = [SHEETS_BY_NAME[name] for name in ("frontier-openai", "deepseek", "frontier-anthropic")]
    print("\n" + repriced_table({name: [c[i] for i in ids] for name, c in configs.items()}, sheets))
    print("| routed config | steered minus plain accuracy [95% CI] | calls / q, plain -> steered |\n|---|---|---|")
    for config in ROUTED:
        plain, steered = configs[f"plain {config}"], configs[f"s0.25 {config}"]
        diffs = [float(steered[i]["correct"]) - float(plain[i]["correct"]) for i in ids]
        low, high = bootstrap_ci(diffs)
        calls = [sum(c[i]["upstream_calls"] for i in ids) / len(ids) for c in (plain, steered)]
        print(f"| {config} | {sum(diffs) / len(ids):+.1%} [{low:+.1%}, {high:+.1%}] | {calls[0]:.2f} -> {calls[1]:.2f} |")


if __name__ == "__main__":
    main()
