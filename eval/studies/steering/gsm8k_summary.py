"""GSM8K steering lanes (eval/studies/steering/gsm8k_brevity.sh, gsm8k_answer_line.sh): plain against
steered, local only, from the runs in results/steering/runs/.

    .venv/bin/python -m eval.studies.steering.gsm8k_summary choose brevity|line
    .venv/bin/python -m eval.studies.steering.gsm8k_summary report STEERED_RUN

Per run: accuracy (Wilson 95%), answer tokens a question, the share cut at the 512-token limit, the
share with the prompt's 'Answer: <number>' last line (the extractor's rule). `report` adds the
steered run's accuracy and answer-line share minus plain's (paired bootstrap 95%, on the questions
both hold).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fitting.records import read_records
from fitting.summary import bootstrap_ci, mcnemar_p, wilson_ci

RUNS = Path(__file__).resolve().parents[3] / "results" / "steering" / "runs"


def records(run: str, config: str) -> dict[str, dict]:
    return {r["id"]: r for r in read_records(RUNS / run / f"gsm8k__{config}.jsonl")}


def row(name: str, held: dict[str, dict], ids: list[str]) -> str:
    rows = [held[i] for i in ids]
    n, correct = len(rows), sum(r["correct"] for r in rows)
    low, high = wilson_ci(correct, n)
    tokens = sum(r["answer_tokens"] for r in rows) / n
    cut = sum(r["finish_reason"] == "length" for r in rows) / n
    answer_line = sum(r["rule"] == "answer_line" for r in rows) / n
    accuracy = f"{correct / n:.1%} [{low:.1%}, {high:.1%}]"
    return f"| {name} | {n} | {accuracy} | {tokens:.0f} | {cut:.0%} | {answer_line:.1%} |"


def table(runs: dict[str, dict[str, dict]]) -> list[str]:
    ids = sorted(set.intersection(*(set(r) for r in runs.values())))
    print("| run | n | accuracy | answer tokens / q | cut at 512 | 'Answer:' line |")
    print("|---|---|---|---|---|---|")
    for name, held in runs.items():
        print(row(name, held, ids))
    return ids


def paired(plain: dict[str, dict], steered: dict[str, dict], ids: list[str], what: str) -> str:
    """Steered minus plain on `what` (a record's truth: correct, or ending with the answer line)."""
    def holds(record: dict) -> float:
        return float(record["correct"] if what == "accuracy" else record["rule"] == "answer_line")
    diffs = [holds(steered[i]) - holds(plain[i]) for i in ids]
    gained, lost = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    low, high = bootstrap_ci(diffs)
    return (f"{what}, steered minus plain: {sum(diffs) / len(ids):+.1%} [{low:+.1%}, {high:+.1%}], "
            f"{gained} gained / {lost} lost (McNemar p {mcnemar_p(gained, lost):.2g})")


CHOOSE_RUNS = {"brevity": {s: f"gsm8k_choose_s{s}" for s in ("0.1", "0.2", "0.35")},
               "line": {s: f"gsm8k_choose_line_s{s}" for s in ("0.1", "0.15", "0.25")}}


def main(stage: str, which: str) -> None:
    if stage == "choose":
        runs = {"plain": records("gsm8k_choose_plain", "local")}
        runs |= {f"scale {s}": records(run, "local") for s, run in CHOOSE_RUNS[which].items()}
        table({name: held for name, held in runs.items() if held})
        return
    runs = {"plain": records("gsm8k_report_plain", "local"), which: records(which, "local")}
    ids = table(runs)
    for what in ("accuracy", "answer line"):
        print(paired(*runs.values(), ids, what))


if __name__ == "__main__":
    main(*sys.argv[1:])
