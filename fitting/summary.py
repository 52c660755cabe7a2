"""Per-config metrics from per-item records: accuracy with a bootstrap interval, tokens, cost, speed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.online_check import wilson

RESAMPLES = 2000


def bootstrap_ci(values: Sequence[float], resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean (items resampled with replacement)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def wilson_ci(successes: int, n: int) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion `successes / n` (nan with n = 0), as the
    gateway's shadow figures compute it."""
    return wilson(successes, n) or (float("nan"), float("nan"))


def mcnemar_p(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p-value: the chance, if a config were no better than its base, of a
    split of the discordant questions at least this uneven (binomial, p = 1/2)."""
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def upstream_written(record: dict[str, Any]) -> int:
    """Answer tokens the upstream wrote (a cache hit replays an upstream continuation)."""
    return record["upstream_tokens"] + record["cache_tokens"]


JSON_RULES = ("json", "schema_invalid", "invalid_json")  # structured-output scoring (fitting.answers)


def json_rates(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """For structured-output runs: how many replies parse, and how many fit the schema, of all
    replies and of those that finished (were not cut by max_tokens)."""
    if not any(r["rule"] in JSON_RULES for r in records):
        return {}
    finished = [r for r in records if r["finish_reason"] == "stop"]
    return {
        "valid_json": sum(r["rule"] != "invalid_json" for r in records) / len(records),
        "schema_valid": sum(r["rule"] == "json" for r in records) / len(records),
        "finished": len(finished),
        "schema_valid_finished": sum(r["rule"] == "json" for r in finished) / len(finished) if finished else None,
    }


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The summary of one config over `records` (one per item)."""
    n = len(records)
    if n == 0:
        return {"n": 0}
    correct = [1.0 if r["correct"] else 0.0 for r in records]
    low, high = bootstrap_ci(correct)
    tokens = sum(r["answer_tokens"] for r in records)
    upstream = sum(upstream_written(r) for r in records)
    prompt_billed = sum(r["upstream_prompt_tokens"] for r in records)
    completion_billed = sum(r["upstream_completion_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    return json_rates(records) | {
        "n": n,
        "accuracy": sum(correct) / n,
        "ci95": [low, high],
        "answer_tokens": tokens,
        "upstream_tokens": upstream,
        "upstream_share": upstream / tokens if tokens else 0.0,
        "first_token_upstream": sum(1 for r in records if r["sources"][:1] in ("U", "C")) / n,
        "upstream_calls": sum(r["upstream_calls"] for r in records),
        "upstream_calls_per_item": sum(r["upstream_calls"] for r in records) / n,
        "billed_prompt_tokens": prompt_billed,
        "billed_completion_tokens": completion_billed,
        "billed_tokens_per_item": (prompt_billed + completion_billed) / n,
        "cost_usd": sum(r["upstream_cost_usd"] for r in records),
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "finished_by_length": sum(1 for r in records if r["finish_reason"] == "length"),
        "degraded_items": sum(1 for r in records if r["degraded"]),
        "no_answer_extracted": sum(1 for r in records if r["rule"] == "none"),
    }
