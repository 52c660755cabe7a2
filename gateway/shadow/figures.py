"""From pooled shadow counters to figures: agreement with its Wilson 95% interval, routed cost
against upstream-only's for the same sampled requests, the savings, the share sampled.

The Store keeps one hash of counters per alias (see `fields`); a tenant's counters are the same
names behind the prefix `t:<tenant>:` (tenant ids hold no ':'), answer formats' behind
`fmt:<format>:`, skips are `skip:<reason>`. Requests that ran other routing than the alias's own
(a tenant's or the request's `routing` changed it) count the same names behind `o:` (OVERRIDDEN):
kept apart, since they say nothing about the alias's routing. Costs are in the price sheet's
currency (USD).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.online_check import wilson

CURRENCY = "USD"
SKIP_REASONS = ("budget", "tenant_share", "breaker", "queue", "store", "failed", "unsupported", "length")
OVERRIDDEN = "o:"  # the prefix of the counters of requests whose routing was overridden


def tenant_prefix(tenant: str) -> str:
    return f"t:{tenant}:"


def check_version_prefix(version: int | None) -> str:
    """The prefix of a learning alias's counters while `version` of its learned check routes (None:
    the cold start), so each version's measured agreement and cost are counted apart."""
    return f"l:{'cold' if version is None else version}:"


def format_prefix(fmt: str) -> str:
    return f"fmt:{fmt}:"


@dataclass(frozen=True)
class Figures:
    """One alias's (or one tenant's on it) shadow figures, from pooled counters."""

    eligible: int = 0  # token-level answers that could have been sampled
    sampled: int = 0  # of them, drawn by the rate
    samples: int = 0  # shadow answers compared
    agreed: int = 0
    routed_cost: float = 0.0  # what the routed answers of the compared samples billed upstream
    upstream_cost: float = 0.0  # what asking the upstream directly billed for the same requests
    skipped: dict[str, int] = field(default_factory=dict)
    by_format: dict[str, tuple[int, int]] = field(default_factory=dict)  # format -> (samples, agreed)

    @property
    def agreement(self) -> float | None:
        return self.agreed / self.samples if self.samples else None

    @property
    def interval(self) -> tuple[float, float] | None:
        return wilson(self.agreed, self.samples)

    @property
    def savings(self) -> float:
        return self.upstream_cost - self.routed_cost

    @property
    def cost_ratio(self) -> float | None:
        return self.routed_cost / self.upstream_cost if self.upstream_cost > 0 else None

    @property
    def share_sampled(self) -> float | None:
        return self.samples / self.eligible if self.eligible else None

    def body(self) -> dict[str, Any]:
        """The JSON shape of GET /admin/quality's `figures`."""
        interval = self.interval
        return {
            "eligible": self.eligible, "sampled": self.sampled, "samples": self.samples, "agreed": self.agreed,
            "agreement": _round(self.agreement), "interval": [round(x, 4) for x in interval] if interval else None,
            "share_sampled": _round(self.share_sampled), "currency": CURRENCY,
            "routed_cost": round(self.routed_cost, 9), "upstream_only_cost": round(self.upstream_cost, 9),
            "savings": round(self.savings, 9), "cost_ratio": _round(self.cost_ratio),
            "skipped": dict(self.skipped),
            "by_format": {fmt: {"samples": n, "agreed": k, "agreement": _round(k / n if n else None)}
                          for fmt, (n, k) in sorted(self.by_format.items())},
        }


def figures_of(counts: Mapping[str, float], prefix: str = "") -> Figures:
    """The figures held in `counts` under `prefix` ("" for the alias, `tenant_prefix(t)` for a tenant,
    OVERRIDDEN and then a tenant's for overridden requests)."""
    def get(name: str) -> float:
        return counts.get(prefix + name, 0.0)

    skipped = {reason: int(get(f"skip:{reason}")) for reason in SKIP_REASONS if get(f"skip:{reason}")}
    formats: dict[str, tuple[int, int]] = {}
    start = prefix + "fmt:"
    for key, value in counts.items():
        if key.startswith(start) and key.endswith(":samples"):
            fmt = key[len(start):-8]
            formats[fmt] = (int(value), int(get(f"{format_prefix(fmt)}agreed")))
    return Figures(int(get("eligible")), int(get("sampled")), int(get("samples")), int(get("agreed")),
                   get("routed_cost"), get("upstream_cost"), skipped, formats)


def tenants_in(counts: Mapping[str, float], prefix: str = "") -> list[str]:
    """The tenants that have counters in `counts` under `prefix` ("" or OVERRIDDEN), sorted."""
    start = prefix + "t:"
    return sorted({key[len(start):].split(":", 1)[0] for key in counts if key.startswith(start)})


def sample_counts(tenant: str, fmt: str, agreed: bool, routed_cost: float, upstream_cost: float,
                  prefix: str = "") -> dict[str, float]:
    """The counters one compared sample adds: to the alias, to its tenant, to its answer format
    (all under `prefix`: OVERRIDDEN for a request whose routing was overridden)."""
    one = {"samples": 1.0, "agreed": float(agreed), "routed_cost": routed_cost, "upstream_cost": upstream_cost}
    counts = dict(one)
    counts.update({tenant_prefix(tenant) + key: value for key, value in one.items()})
    counts.update({format_prefix(fmt) + "samples": 1.0, format_prefix(fmt) + "agreed": float(agreed)})
    return {prefix + key: value for key, value in counts.items()}


def timeline(buckets: Iterable[tuple[int, Mapping[str, float]]]) -> list[dict[str, Any]]:
    """(bucket start, its counters) in time order -> the plot's points (buckets without samples kept,
    with agreement null, so the plot shows gaps as gaps)."""
    points = []
    for start, counts in buckets:
        n, k = int(counts.get("samples", 0)), int(counts.get("agreed", 0))
        points.append({"start": start, "samples": n, "agreed": k, "agreement": _round(k / n if n else None)})
    return points


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
