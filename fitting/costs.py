"""What each configuration's answers cost on a price sheet, per correct answer.

Records keep what the upstream billed (prompt, cached and completion tokens, calls, compute time),
so any run can be re-priced on any sheet without decoding again: `python -m eval costs --sheet
NAME_OR_FILE ...` (built-in sheets in SHEETS_BY_NAME, or a YAML/JSON file of PriceSheet's fields),
against the upstream-only config of the same run. `report --costs` prints the older three-column
view: self-hosted compute, DeepSeek's list prices with its cache ("cache discount"), and the same
prices with every prompt token at the miss price ("no cache").
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class PriceSheet:
    """A provider's prices in USD per million tokens, and when its prompt cache applies.

    `cache_min_prompt_tokens`: a call whose prompt is shorter is never cached (OpenAI and
    Anthropic: 1,024; DeepSeek: 64; a self-hosted server: 0); `cache_write`: what a prompt token
    written to the cache costs (Anthropic: 1.25x input; None: the input price);
    `compute_usd_per_hour`: a self-hosted upstream's machine, priced by its compute time instead of
    tokens (the other prices are then 0)."""

    name: str
    input: float = 0.0
    cached_read: float = 0.0
    output: float = 0.0
    cache_write: float | None = None
    cache_min_prompt_tokens: float = 0
    compute_usd_per_hour: float | None = None
    source: str = ""

    def usd(self, record: dict[str, Any], shared_prefix: int = 0) -> float:
        """What one answer's upstream calls cost on this sheet, from its billed counts.

        Records hold per-answer sums: a call's prompt is taken as their mean (whether the cache
        applies is decided on it). `shared_prefix` models every question behind one system prompt
        of that many tokens (each call's prompt grows by it, and where the cache applies it is read
        from the cache: the same prefix for every request, written once)."""
        if self.compute_usd_per_hour is not None:
            return record.get("upstream_compute_ms", 0.0) / 3.6e6 * self.compute_usd_per_hour
        if not record["upstream_calls"] and not record["upstream_prompt_tokens"]:
            return 0.0  # answered locally: no call, nothing billed
        calls = max(1, record["upstream_calls"])  # a warm-up is billed without counting as a hand-off
        prompt = record["upstream_prompt_tokens"] + shared_prefix * calls
        cached = record.get("upstream_cached_tokens", 0) + shared_prefix * calls
        if prompt / calls < self.cache_min_prompt_tokens:
            cached = 0
        fresh_price = self.input if self.cache_write is None or cached == 0 else self.cache_write
        return ((prompt - cached) * fresh_price + cached * self.cached_read
                + record["upstream_completion_tokens"] * self.output) / 1e6


SHEETS_BY_NAME = {sheet.name: sheet for sheet in (
    PriceSheet("deepseek", 0.28, 0.028, 0.42, cache_min_prompt_tokens=64,
               source="DeepSeek's published list prices (cache miss, hit, output); caching from 64 tokens"),
    PriceSheet("frontier-openai", 1.25, 0.125, 10.0, cache_min_prompt_tokens=1024,
               source="an OpenAI-class frontier sheet: output 8x input, cached reads 0.1x, caching from 1,024 tokens"),
    PriceSheet("frontier-anthropic", 3.0, 0.3, 15.0, cache_write=3.75, cache_min_prompt_tokens=1024,
               source="an Anthropic-class sheet: output 5x input, cache writes 1.25x, reads 0.1x, from 1,024 tokens"),
    PriceSheet("self-hosted", compute_usd_per_hour=2.0,
               source="a self-hosted upstream: its compute time (prompt + generation ms) at USD 2 an hour"),
)}
# report --costs: DeepSeek's list prices with its cache, and as on a provider whose cache does not apply
SHEETS = {"cache discount": dataclasses.replace(SHEETS_BY_NAME["deepseek"], name="cache discount",
                                                cache_min_prompt_tokens=0),
          "no cache": dataclasses.replace(SHEETS_BY_NAME["deepseek"], name="no cache",
                                          cache_min_prompt_tokens=math.inf)}


def load_sheet(spec: str) -> PriceSheet:
    """A built-in sheet by name, or one from a YAML or JSON file with PriceSheet's fields."""
    if spec in SHEETS_BY_NAME:
        return SHEETS_BY_NAME[spec]
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"no price sheet {spec!r}: name one of {', '.join(SHEETS_BY_NAME)} or give a file")
    fields = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    return PriceSheet(**{"name": path.stem, **fields})


def usd(records: Sequence[dict[str, Any]], sheet: str) -> float:
    return sum(SHEETS[sheet].usd(r) for r in records)


def repriced_table(configs: dict[str, list[dict[str, Any]]], sheets: Sequence[PriceSheet], baseline: str = "upstream",
                   shared_prefix: int = 0) -> str:
    """Markdown: per config, accuracy, calls per question and, on each sheet, USD per 1,000 correct
    answers and its ratio to the `baseline` config's (asking the upstream for every answer)."""
    header = "| config | n | accuracy | calls / q | " + " | ".join(f"{s.name}: USD / 1k correct (x {baseline})"
                                                                  for s in sheets) + " |"
    lines = [header, "|" + "---|" * (4 + len(sheets))]
    per_correct = {name: {s.name: _per_1k_correct(records, s, shared_prefix) for s in sheets}
                   for name, records in configs.items() if records}
    for name, records in configs.items():
        if not records:
            continue
        n, correct = len(records), sum(1 for r in records if r["correct"])
        cells = []
        for sheet in sheets:
            cost, base = per_correct[name][sheet.name], per_correct.get(baseline, {}).get(sheet.name)
            ratio = f" ({cost / base:.2f}x)" if base and math.isfinite(cost) and math.isfinite(base) else ""
            cells.append(f"{cost:.3f}{ratio}")
        lines.append(f"| {name} | {n} | {correct / n:.1%} | {sum(r['upstream_calls'] for r in records) / n:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def answer_oracles(local: Sequence[dict[str, Any]], upstream: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Two choices between the local answer and asking the upstream directly that read the gold
    answer, so no gateway can make them; they price what a better choice could save (rows missing
    from either run are left out):

    - a perfect answer check: the upstream is asked for exactly the local answers that are wrong.
      No check of the local answer (a draft, an escalation, `escalate_below`) can be more accurate,
      and one as accurate pays at least this.
    - knowing the upstream's answer too: it is asked only where it is right and the local answer
      is not. The most accurate choice at the least cost; below the first only by not paying for
      questions the upstream gets wrong as well, which no choice made before asking can know."""
    asked = {record["id"]: record for record in upstream}
    pairs = [(record, asked[record["id"]]) for record in local if record["id"] in asked]
    return {"perfect answer check": [mine if mine["correct"] else theirs for mine, theirs in pairs],
            "knowing both answers": [theirs if theirs["correct"] and not mine["correct"] else mine
                                     for mine, theirs in pairs]}


def _per_1k_correct(records: Sequence[dict[str, Any]], sheet: PriceSheet, shared_prefix: int) -> float:
    correct = sum(1 for r in records if r["correct"])
    return 1000 * sum(sheet.usd(r, shared_prefix) for r in records) / correct if correct else math.inf


def cost_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per question and per correct answer: billed tokens, compute and dollars on each sheet."""
    n = len(records)
    correct = sum(1 for r in records if r["correct"])
    per_correct = 1 / correct if correct else float("nan")
    compute_ms = sum(r.get("upstream_compute_ms", 0.0) for r in records)
    prompt = sum(r["upstream_prompt_tokens"] for r in records)
    cached = sum(r.get("upstream_cached_tokens", 0) for r in records)
    completion = sum(r["upstream_completion_tokens"] for r in records)
    return {
        "n": n, "correct": correct, "accuracy": correct / n if n else 0.0,
        "calls_per_q": sum(r["upstream_calls"] for r in records) / n,
        "prompt_per_q": prompt / n, "cached_per_q": cached / n, "completion_per_q": completion / n,
        "evaluated_per_q": (prompt - cached + completion) / n,
        "compute_ms_per_q": compute_ms / n, "compute_s_per_correct": compute_ms / 1000 * per_correct,
        **{f"usd_per_1k_correct[{sheet}]": 1000 * usd(records, sheet) * per_correct for sheet in SHEETS},
    }


def cost_table(configs: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table: accuracy, calls, billed tokens and the cost per correct answer on each sheet."""
    lines = ["| config | n | accuracy | upstream calls / q | billed prompt / cached / completion per q "
             "| evaluated by the upstream / q | upstream compute ms / q | self-hosted: compute s / correct "
             "| cache discount: USD / 1k correct | no cache: USD / 1k correct |", "|" + "---|" * 10]
    for name, records in configs.items():
        s = cost_summary(records)
        lines.append(
            f"| {name} | {s['n']} | {s['accuracy']:.1%} | {s['calls_per_q']:.2f} | {s['prompt_per_q']:.0f} / "
            f"{s['cached_per_q']:.0f} / {s['completion_per_q']:.1f} | {s['evaluated_per_q']:.0f} "
            f"| {s['compute_ms_per_q']:.0f} | {s['compute_s_per_correct']:.2f} "
            f"| {s['usd_per_1k_correct[cache discount]']:.3f} | {s['usd_per_1k_correct[no cache]']:.3f} |")
    return "\n".join(lines) + "\n"


def cost_plot(configs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    """Cost per correct answer (x, one panel per sheet) against accuracy (y)."""
    summaries = {name: cost_summary(records) for name, records in configs.items() if records}
    panels = [("compute_s_per_correct", "self-hosted: upstream compute s per correct answer"),
              *((f"usd_per_1k_correct[{sheet}]", f"{sheet}: USD per 1k correct answers") for sheet in SHEETS)]
    _scatter([(label, {name: (s[key], s["accuracy"]) for name, s in summaries.items()}) for key, label in panels],
             path, title)


def repriced_points(configs: dict[str, list[dict[str, Any]]], sheets: Sequence[PriceSheet], baseline: str = "upstream",
                    shared_prefix: int = 0) -> tuple[list[tuple[str, dict[str, tuple[float, float]]]], dict[str, float]]:
    """Per sheet, (its name, {config: (cost per correct answer as a multiple of the `baseline`
    config's, accuracy)}), and the accuracy of each config that costs nothing (local only); a config
    with no correct answer is left out."""
    panels, levels = [], {}
    for sheet in sheets:
        base = _per_1k_correct(configs[baseline], sheet, shared_prefix)
        points = {}
        for name, records in configs.items():
            cost = _per_1k_correct(records, sheet, shared_prefix) if records else math.inf
            accuracy = sum(1 for r in records if r["correct"]) / len(records) if records else 0.0
            if cost == 0:
                levels[name] = accuracy
            elif cost < math.inf:
                points[name] = (cost / base, accuracy)
        panels.append((sheet.name, points))
    return panels, levels


def repriced_plot(configs: dict[str, list[dict[str, Any]]], sheets: Sequence[PriceSheet], path: Path, title: str,
                  baseline: str = "upstream", shared_prefix: int = 0) -> None:
    """Accuracy (y) against cost per correct answer as a multiple of the `baseline` config's (x), one
    panel per sheet, the baseline's 1x and half of it marked, and a config that costs nothing as a
    horizontal line at its accuracy (`repriced_points`)."""
    panels, levels = repriced_points(configs, sheets, baseline, shared_prefix)
    _scatter([(f"{name}: cost per correct answer (x {baseline})", points) for name, points in panels],
             path, title, marks=(0.5, 1.0), levels=levels)


def _scatter(panels: Sequence[tuple[str, dict[str, tuple[float, float]]]], path: Path, title: str,
             marks: Sequence[float] = (), levels: dict[str, float] | None = None) -> None:
    """One panel per (x label, {config: (x, accuracy)}), the same marker per config in every panel;
    `marks` are vertical lines at those x, `levels` horizontal ones at a config's accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*dict.fromkeys(name for _, points in panels for name in points), *(levels or {})]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), sharey=True, squeeze=False)
    markers = "osD^v<>phX*"
    for ax, (label, points) in zip(axes[0], panels):
        for name, (x, accuracy) in points.items():
            index = names.index(name)
            ax.scatter(x, accuracy, s=40, marker=markers[index % len(markers)], color=f"C{index % 10}",
                       label=name, alpha=0.8)
        for mark in marks:
            ax.axvline(mark, color="grey", linestyle=":", linewidth=1)
        for name, accuracy in (levels or {}).items():
            ax.axhline(accuracy, color="black", linestyle="--", linewidth=1, label=f"{name} (costs nothing)")
        ax.set_xlabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    handles = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(3, len(names)), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(names) - 1) // 3), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
