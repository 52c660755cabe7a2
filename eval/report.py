"""The results table (markdown) and the plot of accuracy against the share of upstream tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval import querylevel
from fitting.answers import score
from fitting.configs import ROUTED, ConfigSpec, parse_config
from fitting.datasets import Item
from fitting.records import configs_in, in_rows, read_records
from fitting.summary import bootstrap_ci, mcnemar_p, summarize

ORDER = {"local": 0, "upstream": 1, "oracle": 2, "query": 3, "query-billed": 4,
         **{p: 5 + i for i, p in enumerate(ROUTED)}}


@dataclass(frozen=True)
class Row:
    """One line of the table and one point of the plot."""

    name: str
    family: str  # local | upstream | oracle | query | query-billed | a routing policy
    summary: dict[str, Any]


def load(run_dir: Path, dataset: str, rows: slice, only: Sequence[str] = (), common: bool = True,
         items: Sequence[Item] = ()) -> dict[str, tuple[ConfigSpec, list[dict[str, Any]]]]:
    """Config name -> (spec, records in `rows`), restricted to the items every config has if `common`.

    With `items`, answers are scored again from their text with the current extraction rules
    (cheap for CSQA and GSM8K), so a fix to fitting/answers.py needs no new decoding.
    """
    by_id = {item.id: item for item in items}
    found = {}
    for name, path in configs_in(run_dir, dataset).items():
        if only and name not in only:
            continue
        records = in_rows(read_records(path), rows)
        if by_id:
            records = [_rescored(dataset, r, by_id[r["id"]]) if r["id"] in by_id else r for r in records]
        found[name] = (parse_config(name), records)
    if common and found:
        shared = set.intersection(*({r["id"] for r in records} for _, records in found.values()))
        found = {name: (spec, [r for r in records if r["id"] in shared]) for name, (spec, records) in found.items()}
    return found


def _rescored(dataset: str, record: dict[str, Any], item: Item) -> dict[str, Any]:
    if record.get("error"):
        return record
    scored = score(dataset, item, record["text"])
    return {**record, "pred": scored.pred, "correct": scored.correct, "rule": scored.rule}


def build_rows(configs: dict[str, tuple[ConfigSpec, list[dict[str, Any]]]], match_policy: str | None = "entropy"
               ) -> tuple[list[Row], list[querylevel.QueryPoint]]:
    """Table rows (configs, then query-level points matched to `match_policy`'s shares) and the
    full query-level curve (empty without both baselines)."""
    rows = [Row(name, spec.family, summarize(records)) for name, (spec, records) in configs.items() if records]
    points: list[querylevel.QueryPoint] = []
    if "local" in configs and "upstream" in configs:
        points = querylevel.curve(configs["local"][1], configs["upstream"][1])
        targets = [r for r in rows if r.family == match_policy] or [r for r in rows if r.family in ROUTED]
        n = len(points) - 1
        for target in targets:
            point = querylevel.matching(points, target.summary["upstream_share"])
            rows.append(Row(f"query-level {point.k}/{n} (share of {target.name})", "query", point.summary))
            point = querylevel.matching(points, target.summary["billed_tokens_per_item"], "billed_tokens_per_item")
            rows.append(Row(f"query-level {point.k}/{n} (billed tokens of {target.name})", "query-billed",
                            point.summary))
    rows.sort(key=lambda r: (ORDER.get(r.family, 99), r.summary.get("upstream_share", 0.0)))
    return rows, points


def markdown_table(rows: Sequence[Row]) -> str:
    """Accuracy with its bootstrap 95% interval, upstream share (of all answer tokens, and how often
    the first one), calls, billed tokens, cost, speed."""
    header = ("| config | n | accuracy [95% CI] | upstream share of answer tokens | first token upstream "
              "| upstream calls / q | billed upstream tokens / q (prompt + completion) | cost / 1k q (USD) "
              "| answer tok/s |")
    lines = [header, "|" + "---|" * 9]
    for row in rows:
        s = row.summary
        low, high = s["ci95"]
        billed = f"{s['billed_tokens_per_item']:.0f} ({s['billed_prompt_tokens'] / s['n']:.0f} + " \
                 f"{s['billed_completion_tokens'] / s['n']:.0f})"
        lines.append(
            f"| {row.name} | {s['n']} | {s['accuracy']:.1%} [{low:.1%}, {high:.1%}] | {s['upstream_share']:.1%} "
            f"| {s['first_token_upstream']:.0%} "
            f"| {s['upstream_calls_per_item']:.1f} | {billed} | {1000 * s['cost_usd'] / s['n']:.3f} "
            f"| {s['tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def paired_table(configs: dict[str, tuple[ConfigSpec, list[dict[str, Any]]]], base: str = "local",
                 reference: str = "upstream") -> str:
    """Per config, against `base` on the same questions: questions it gets right that `base` gets
    wrong and the reverse, the accuracy change with its paired bootstrap 95% interval and the exact
    McNemar p-value, answers that end on the same extracted value as `reference`'s, and answers cut
    at the token limit. Empty without both `base` and `reference`."""
    if base not in configs or reference not in configs:
        return ""
    base_by_id = {r["id"]: r for r in configs[base][1]}
    ref_by_id = {r["id"]: r for r in configs[reference][1]}
    lines = [f"| config | n | right where {base} is wrong | wrong where {base} is right "
             f"| accuracy change [95% CI] | McNemar p | same answer as {reference} | cut at the token limit |",
             "|" + "---|" * 8]
    for name, (_, records) in configs.items():
        shared = [r for r in records if r["id"] in base_by_id and r["id"] in ref_by_id]
        change = [float(r["correct"]) - float(base_by_id[r["id"]]["correct"]) for r in shared]
        gained, lost = change.count(1.0), change.count(-1.0)
        low, high = bootstrap_ci(change)
        same = sum(1 for r in shared if r["pred"] is not None and r["pred"] == ref_by_id[r["id"]]["pred"])
        cut = sum(1 for r in shared if r["finish_reason"] == "length")
        lines.append(f"| {name} | {len(shared)} | {gained} | {lost} | {(gained - lost) / max(1, len(shared)):+.1%} "
                     f"[{low:+.1%}, {high:+.1%}] | {mcnemar_p(gained, lost):.3g} | {same} | {cut} |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], points: Sequence[querylevel.QueryPoint], path: Path, title: str) -> None:
    """Accuracy against the upstream's share of answer tokens (left) and against billed upstream
    tokens per question (right): a curve per policy, baselines, oracle and query-level as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True)
    for ax, key, label in ((axes[0], "upstream_share", "share of answer tokens written by the upstream"),
                           (axes[1], "billed_tokens_per_item", "billed upstream tokens per question")):
        _panel(ax, rows, points, key)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_xlim(-0.03, 1.03)
    axes[0].set_ylabel("accuracy (bootstrap 95% interval)")
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _panel(ax: Any, rows: Sequence[Row], points: Sequence[querylevel.QueryPoint], key: str) -> None:
    if points:
        ax.plot([p.summary[key] for p in points], [p.summary["accuracy"] for p in points],
                color="0.6", linestyle="--", linewidth=1, label="query-level (by local mean entropy)")
    for family in ROUTED:
        mine = sorted((r for r in rows if r.family == family), key=lambda r: r.summary[key])
        if mine:
            _points(ax, mine, key, marker="o", linestyle="-", label=family)
    markers = {"query": ("o", "0.5", "query-level at equal share"),
               "query-billed": ("D", "0.3", "query-level at equal billed tokens"),
               "local": ("s", "black", "local only"), "upstream": ("^", "black", "upstream only"),
               "oracle": ("*", "goldenrod", "oracle")}
    for family, (marker, color, label) in markers.items():
        mine = [r for r in rows if r.family == family]
        if mine:
            size = 12 if marker == "*" else 7
            _points(ax, mine, key, marker=marker, linestyle="none", color=color, label=label, size=size)


def _points(ax: Any, rows: Sequence[Row], key: str, marker: str, linestyle: str, label: str | None,
            color: str | None = None, size: int = 6) -> None:
    xs = [r.summary[key] for r in rows]
    ys = [r.summary["accuracy"] for r in rows]
    errors = [[y - r.summary["ci95"][0] for y, r in zip(ys, rows)],
              [r.summary["ci95"][1] - y for y, r in zip(ys, rows)]]
    ax.errorbar(xs, ys, yerr=errors, marker=marker, linestyle=linestyle, label=label, color=color,
                markersize=size, capsize=2, elinewidth=0.8)
