"""Answers asked afresh: fit an answer check on local answers, and what it does to a run's answers.

`fit` trains the check (policies/answer_check.py) on the local model's own greedy answers of a
run, labelled by whether each was correct; its thresholds are the `escalate_below` that asks afresh
for given shares of those answers. `derived` builds the records a config `<base>,afresh=P` would
write from the records of `<base>` and `upstream` on the same items: both are greedy and
deterministic, and the gateway's fresh call is the upstream-only config's one call for the whole
answer, so an escalated answer is the upstream's record (billed on top of what the base answer's
hand-offs billed) and the rest are the base's. `python -m eval run` decodes such a config for real,
and `agreement` counts the answers a decoded run and the derived records share.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from fitting.learn import fit_logistic
from policies.answer_check import AnswerCheck, AnswerStats

BILLED = ("upstream_calls", "upstream_prompt_tokens", "upstream_completion_tokens", "upstream_cached_tokens",
          "upstream_compute_ms", "upstream_cost_usd")


def fit(records: Sequence[dict[str, Any]], shares: Sequence[float], model_sha256: str, meta: dict[str, Any],
        l2: float = 1.0, stats: dict[str, AnswerStats] | None = None, at_tokens: int | None = None) -> AnswerCheck:
    """An answer check fitted on local answers (`correct` is the label), with the escalate_below
    that asks afresh for each share of them. `stats`: what it reads of each answer, by id (default:
    the whole answer, as recorded; see `answer_stats` for a check read at `at_tokens`)."""
    stats = stats if stats is not None else answer_stats(records)
    x = np.array([stats[r["id"]].features() for r in records])
    y = np.array([float(r["correct"]) for r in records])
    weights, bias, mean, scale = fit_logistic(x, y, l2)
    check = AnswerCheck(weights, bias, mean, scale, {}, model_sha256,
                        {**meta, "fit_answers": len(records), "fit_accuracy": round(float(y.mean()), 4)}, at_tokens)
    confidences = confidences_of(check, records, stats)
    return dataclasses.replace(check, shares={float(s): round(float(np.quantile(confidences, s)), 5) for s in shares})


def confidences_of(check: AnswerCheck, records: Sequence[dict[str, Any]],
                   stats: dict[str, AnswerStats] | None = None) -> np.ndarray:
    stats = stats if stats is not None else answer_stats(records)
    return np.array([check.confidence(stats[r["id"]]) for r in records])


def answer_stats(records: Sequence[dict[str, Any]], at_tokens: int | None = None,
                 analysed: dict[str, dict[str, Any]] | None = None) -> dict[str, AnswerStats]:
    """What a check reads of each answer, by id: the whole answer as its record keeps it, or, for a
    check read at `at_tokens`, the answer's first tokens from its analysis (`analysed`, by id; answers
    without one are left out)."""
    if at_tokens is None:
        return {r["id"]: AnswerStats.of_record(r) for r in records}
    analysed = analysed or {}
    return {r["id"]: prefix_stats(analysed[r["id"]], r, at_tokens) for r in records if r["id"] in analysed}


def prefix_stats(analysis: dict[str, Any], record: dict[str, Any], k: int | None) -> AnswerStats:
    """The check's aggregates over the first `k` steps of a local answer (all of them if None or
    the answer is shorter)."""
    n = analysis["n"] if k is None else min(k, analysis["n"])
    entropy, top1 = analysis["entropy"][:n] or [0.0], analysis["top1"][:n] or [1.0]
    whole = n == analysis["n"]
    return AnswerStats(statistics.fmean(entropy), max(entropy), statistics.fmean(top1), entropy[0], n,
                       whole and record["finish_reason"] == "length")


def derived(base: Sequence[dict[str, Any]], upstream: Sequence[dict[str, Any]], check: AnswerCheck | None,
            escalate_below: float, name: str, stats: dict[str, AnswerStats] | None = None) -> list[dict[str, Any]]:
    """The records of config `name` (`<base>,afresh=<escalate_below>`) on the items both runs answered.
    `stats`: what the check rated of each answer, by id (default: the whole answer, as recorded); an
    answer rated on its first tokens is escalated after those, its time counted pro rata. Without a
    `check`, each base record's own `agreement` rates it (a `local,agree=K` run's agreement check)."""
    fresh = {r["id"]: r for r in upstream}
    stats = stats if stats is not None else answer_stats(base)
    records = []
    for record in base:
        if record["id"] not in fresh:
            continue
        rated = stats[record["id"]]
        confidence = record["agreement"] if check is None else check.confidence(rated)
        if confidence < escalate_below and not record.get("escalated"):  # the upstream finished it already
            out = _escalated(record, fresh[record["id"]], rated.answer_tokens)
        else:
            out = {**record, "afresh": False}
        records.append({**out, "config": name, "answer_confidence": round(confidence, 4), "derived": True})
    return records


def _escalated(base: dict[str, Any], fresh: dict[str, Any], discarded: int) -> dict[str, Any]:
    """The upstream's answer after the base answer's first `discarded` tokens: billed on top of the
    base answer's hand-offs (all of them: which came before the rating is not recorded), timed after
    those tokens."""
    spent = base["wall_s"] * discarded / max(1, base["answer_tokens"])
    record = {**fresh, "afresh": True, "discarded_tokens": discarded, "wall_s": round(spent + fresh["wall_s"], 4)}
    for key in BILLED:
        record[key] = base.get(key, 0) + fresh.get(key, 0)
    return record


def agreement(decoded: Sequence[dict[str, Any]], derived_records: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(answers with the same text and the same afresh decision, answers compared) over the items both hold."""
    by_id = {r["id"]: r for r in derived_records}
    pairs = [(r, by_id[r["id"]]) for r in decoded if r["id"] in by_id]
    return sum(a["text"] == b["text"] and bool(a.get("afresh")) == b["afresh"] for a, b in pairs), len(pairs)
