"""Query-level routing (RouteLLM-style): send whole questions upstream by the small model's doubt.

Each question is scored by the mean entropy of the local model's own greedy answer (the
`local` run); the top-k questions are answered by the upstream alone (the `upstream` run) and the
rest by the local model alone. Both runs are greedy and deterministic, so a mixture of their
recorded answers is exactly what a query-level router would produce; no new decoding is needed.
Its time counts the local answer for every question (the router needs it to score the question)
plus the upstream's for the routed ones. k is chosen so that the share of upstream answer tokens
matches a token-routed point; the report also gives the k that matches its billed upstream tokens,
since every token-level hand-off re-sends the prompt and the two costs differ a lot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fitting.summary import summarize, upstream_written

SCORE_KEY = "mean_entropy"


@dataclass(frozen=True)
class QueryPoint:
    k: int  # questions sent upstream
    records: list[dict[str, Any]]
    summary: dict[str, Any]


def curve(local: Sequence[dict[str, Any]], upstream: Sequence[dict[str, Any]]) -> list[QueryPoint]:
    """Every k from 0 to the number of questions both runs answered."""
    by_id = {r["id"]: r for r in upstream}
    pairs = sorted(((r, by_id[r["id"]]) for r in local if r["id"] in by_id),
                   key=lambda pair: pair[0][SCORE_KEY], reverse=True)
    points = []
    for k in range(len(pairs) + 1):
        mixed = [_routed(lo, up) for lo, up in pairs[:k]] + [lo for lo, _ in pairs[k:]]
        points.append(QueryPoint(k, mixed, summarize(mixed)))
    return points


def matching(points: Sequence[QueryPoint], value: float, key: str = "upstream_share") -> QueryPoint:
    """The point whose summary[`key`] (by default the upstream token share) is closest to `value`."""
    return min(points, key=lambda p: abs(p.summary[key] - value))


def _routed(local: dict[str, Any], upstream: dict[str, Any]) -> dict[str, Any]:
    """The upstream's record, timed as local scoring + upstream answer."""
    record = dict(upstream)
    record["wall_s"] = local["wall_s"] + upstream["wall_s"]
    record["upstream_tokens"] = upstream_written(upstream)
    record["cache_tokens"] = 0
    return record
