"""What `python -m gateway tune` decides from recorded answers, without decoding (fitting/tune.py runs it).

From the `local`, `upstream` and `local,agree=K` records of a run (fitting/runner.py):
- `relabel`: answers without a reference are labelled by agreement with the upstream-only answer
  (`correct` then means "agrees with upstream-only", and upstream-only is right by definition);
- `candidates`: the routings an alias can serve with no file but the answer check fitted here:
  local only, the fitted check at the escalate_below it fitted for each share of the fit answers
  (`local,afresh=P`), and the agreement check at each level its k samples can take
  (`local,agree=K,afresh=P`); each candidate's records are derived as `python -m eval afresh`
  derives them (fitting/afresh.py: an answer asked afresh is the upstream-only record);
- `choose`: the rule, fixed before any report row is looked at: on the choose rows, the most
  accurate candidate whose cost per correct answer is at most `max_cost_ratio` times upstream-only's
  (ties: the cheaper); local only if none is;
- `figures`: a config's held-out figures with intervals, paired against local only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fitting.afresh import derived
from fitting.costs import PriceSheet
from fitting.datasets import Item
from fitting.prompts import labelled
from fitting.summary import bootstrap_ci, mcnemar_p, wilson_ci
from policies.agreement import same_answer
from policies.answer_check import AnswerCheck

Records = list[dict[str, Any]]


def relabel(records: Records, upstream: Records, items: dict[str, Item]) -> Records:
    """`records` with each answer to an item without a reference marked correct when it agrees
    with the upstream-only answer (read in the item's format; `auto`: the upstream answer's); an
    item the upstream did not answer is dropped. Items with a reference keep their scores."""
    fresh = {r["id"]: r for r in upstream}
    out = []
    for record in records:
        item, theirs = items.get(record["id"]), fresh.get(record["id"])
        if item is None or theirs is None:
            continue
        if not labelled(item):
            agrees = same_answer(theirs["text"], record["text"], item.meta.get("format", "auto"))
            record = {**record, "correct": agrees, "label": "agreement"}
        out.append(record)
    return out


def agreement_levels(samples: int) -> list[float]:
    """The escalate_below values that split the agreement check's possible ratings (multiples of
    1 / (samples - 1)) halfway: asking afresh below each level in turn."""
    return [round((j + 0.5) / (samples - 1), 4) for j in range(samples - 1)]


def candidates(local: Records, upstream: Records, check: AnswerCheck | None, agree: Records,
               samples: int) -> dict[str, Records]:
    """Each candidate routing's records on the items local and upstream-only both answered."""
    answered = {u["id"] for u in upstream}
    found: dict[str, Records] = {"local": [r for r in local if r["id"] in answered]}
    if check is not None:
        for below in sorted(set(check.shares.values())):
            name = f"local,afresh={below:g}"
            found[name] = derived(local, upstream, check, below, name)
    rated = [r for r in agree if r.get("agreement") is not None]
    if rated:
        for below in agreement_levels(samples):
            name = f"local,agree={samples},afresh={below:g}"
            found[name] = derived(rated, upstream, None, below, name)
    return found


def per_correct(records: Sequence[dict[str, Any]], sheet: PriceSheet) -> float:
    """USD per correct answer on `sheet` (inf with none correct)."""
    correct = sum(1 for r in records if r["correct"])
    return sum(sheet.usd(r) for r in records) / correct if correct else math.inf


def cost_ratio(records: Sequence[dict[str, Any]], upstream: Sequence[dict[str, Any]], sheet: PriceSheet) -> float:
    """Cost per correct answer as a multiple of upstream-only's on the same items."""
    ids = {r["id"] for r in records}
    base = per_correct([u for u in upstream if u["id"] in ids], sheet)
    cost = per_correct(records, sheet)
    return cost / base if base and math.isfinite(base) else math.nan


@dataclass(frozen=True)
class Choice:
    name: str
    rule: str
    table: list[dict[str, Any]]  # every candidate on the choose rows: name, n, accuracy, afresh, ratio


def choose(found: dict[str, Records], upstream: Records, sheet: PriceSheet, max_cost_ratio: float) -> Choice:
    """The most accurate candidate at most `max_cost_ratio` times upstream-only's cost per correct
    answer on these (choose) rows; ties go to the cheaper; local only if no candidate qualifies."""
    table = []
    for name, records in found.items():
        n = len(records)
        table.append({"name": name, "n": n, "accuracy": _mean(r["correct"] for r in records),
                      "afresh": _mean(bool(r.get("afresh")) for r in records),
                      "ratio": cost_ratio(records, upstream, sheet) if name != "local" else 0.0})
    within = [row for row in table if row["ratio"] <= max_cost_ratio + 1e-12]
    best = max(within, key=lambda row: (round(row["accuracy"], 9), -row["ratio"]), default=None)
    rule = (f"the most accurate candidate on the choose rows at most {max_cost_ratio:g}x upstream-only's cost per "
            "correct answer (ties: the cheaper)")
    return Choice(best["name"] if best else "local", rule, table)


def figures(records: Records, local: Records, upstream: Records, sheet: PriceSheet) -> dict[str, Any]:
    """A config's figures on report rows: accuracy with Wilson and bootstrap 95% intervals, share
    asked afresh, upstream calls per answer, cost per correct answer against upstream-only with a
    paired bootstrap interval, and gained / lost against local only with McNemar's p."""
    n = len(records)
    correct = [float(r["correct"]) for r in records]
    base = {r["id"]: float(r["correct"]) for r in local}
    change = [c - base[r["id"]] for r, c in zip(records, correct) if r["id"] in base]
    gained, lost = change.count(1.0), change.count(-1.0)
    return {
        "n": n, "accuracy": _mean(correct), "wilson95": wilson_ci(int(sum(correct)), n),
        "bootstrap95": bootstrap_ci(correct), "afresh": _mean(bool(r.get("afresh")) for r in records),
        "upstream_calls": _mean(r["upstream_calls"] for r in records),
        "upstream_tokens": _mean(r.get("upstream_tokens", 0) for r in records),
        "usd_per_1k_correct": 1000 * per_correct(records, sheet),
        "cost_ratio": cost_ratio(records, upstream, sheet),
        "cost_ratio95": ratio_ci(records, upstream, sheet),
        "gained": gained, "lost": lost, "mcnemar_p": mcnemar_p(gained, lost),
        "change": (gained - lost) / len(change) if change else math.nan, "change95": bootstrap_ci(change),
    }


def ratio_ci(records: Records, upstream: Records, sheet: PriceSheet, resamples: int = 2000,
             seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of `cost_ratio`, the items resampled together for both."""
    fresh = {u["id"]: u for u in upstream}
    pairs = [(r, fresh[r["id"]]) for r in records if r["id"] in fresh]
    if not pairs:
        return (math.nan, math.nan)
    cost = np.array([[sheet.usd(r), sheet.usd(u)] for r, u in pairs])
    right = np.array([[float(r["correct"]), float(u["correct"])] for r, u in pairs])
    picks = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))
    sums_cost, sums_right = cost[picks].sum(axis=1), right[picks].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        per = sums_cost / sums_right
        ratios = per[:, 0] / per[:, 1]
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return (math.nan, math.nan)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def _mean(values: Any) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else math.nan
