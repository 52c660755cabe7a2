"""GSM8K steering lanes (results/steering/gsm8k_brevity.sh, gsm8k_answer_line.sh): plain against
steered, local only and routed.

    PYTHONPATH=. .venv/bin/python results/steering/gsm8k_summary.py choose brevity|line
    PYTHONPATH=. .venv/bin/python results/steering/gsm8k_summary.py report STEERED_RUN

Per run: accuracy (Wilson 95%), answer tokens a question, the share cut at the 512-token limit, the
share with the prompt's 'Answer: <number>' last line, and hand-offs a question. `report` adds the
steered run's accuracy minus plain's (paired bootstrap 95%, on the questions both hold) and the
routed runs' upstream cost per correct answer on each token sheet, as a multiple of plain routed's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eval.costs import SHEETS_BY_NAME, repriced_table
from eval.summary import bootstrap_ci, mcnemar_p, wilson_ci

RUNS = Path("results/steering/runs")
SHEETS = [SHEETS_BY_NAME[name] for name in ("frontier-openai", "deepseek", "frontier-anthropic")]


def records(run: str, config: str) -> dict[str, dict]:
    path = RUNS / run / f"gsm8k__{config}.jsonl"
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def row(name: str, held: dict[str, dict], ids: list[str]) -> str:
    rows = [held[i] for i in ids]
    n, correct = len(rows), sum(r["correct"] for r in rows)
    low, high = wilson_ci(correct, n)
    tokens = sum(r["answer_tokens"] for r in rows) / n
    cut = sum(r["finish_reason"] == "length" for r in rows) / n
    answer_line = sum(r["rule"] == "answer_line" for r in rows) / n
    calls = sum(r["upstream_calls"] for r in rows) / n
    return (f"| {name} | {n} | {correct / n:.1%} [{low:.1%}, {high:.1%}] | {tokens:.0f} | {cut:.0%} | "
            f"{answer_line:.0%} | {calls:.2f} |")


def table(runs: dict[str, dict[str, dict]]) -> list[str]:
    ids = sorted(set.intersection(*(set(r) for r in runs.values())))
    print("| run | n | accuracy | answer tokens / q | cut at 512 | 'Answer:' line | hand-offs / q |")
    print("|---|---|---|---|---|---|---|")
    for name, held in runs.items():
        print(row(name, held, ids))
    return ids


def paired(plain: dict[str, dict], steered: dict[str, dict], ids: list[str]) -> str:
    diffs = [float(steered[i]["correct"]) - float(plain[i]["correct"]) for i in ids]
    gained, lost = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    low, high = bootstrap_ci(diffs)
    return (f"steered minus plain: {sum(diffs) / len(ids):+.1%} [{low:+.1%}, {high:+.1%}], "
            f"{gained} gained / {lost} lost (McNemar p {mcnemar_p(gained, lost):.2g})")


CHOOSE_RUNS = {"brevity": {s: f"gsm8k_choose_s{s}" for s in ("0.1", "0.2", "0.35")},
               "line": {s: f"gsm8k_choose_line_s{s}" for s in ("0.1", "0.15", "0.25")}}


def main(stage: str, which: str) -> None:
    if stage == "choose":
        runs = {"plain": records("gsm8k_choose_plain", "local")}
        runs |= {f"scale {s}": records(run, "local") for s, run in CHOOSE_RUNS[which].items()}
        table({name: held for name, held in runs.items() if held})
        return
    for config in ("local", "learned@0.05"):
        runs = {f"plain {config}": records("gsm8k_report_plain", config), f"{which} {config}": records(which, config)}
        if not all(runs.values()):
            continue
        ids = table(runs)
        print("\n" + paired(*runs.values(), ids) + "\n")
        if config != "local":
            priced = {name: [held[i] for i in ids] for name, held in runs.items()}
            print(repriced_table(priced, SHEETS, baseline=f"plain {config}"))


if __name__ == "__main__":
    main(*sys.argv[1:])
