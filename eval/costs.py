"""What each configuration's answers cost under three price sheets, per correct answer.

- self-hosted: the upstream's own compute time (prompt + generation ms, as llama-server reports
  it), since a self-hosted upstream costs the machine time it spends.
- cache discount: DeepSeek's published list prices (USD per million tokens: cache miss 0.28,
  cache hit 0.028, output 0.42), applied to the upstream's own billed counts.
- no cache: the same list prices with every prompt token at the miss price, as on a provider
  whose cache does not apply (OpenAI's starts at 1,024-token prompts; these are far shorter).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SHEETS = {"cache discount": (0.28, 0.028, 0.42), "no cache": (0.28, 0.28, 0.42)}  # miss, hit, output per Mtok


def usd(records: Sequence[dict[str, Any]], sheet: str) -> float:
    miss, hit, output = SHEETS[sheet]
    total = 0.0
    for r in records:
        cached = r.get("upstream_cached_tokens", 0)
        total += (r["upstream_prompt_tokens"] - cached) * miss + cached * hit + r["upstream_completion_tokens"] * output
    return total / 1e6


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = {name: cost_summary(records) for name, records in configs.items() if records}
    panels = [("compute_s_per_correct", "self-hosted: upstream compute s per correct answer"),
              *((f"usd_per_1k_correct[{sheet}]", f"{sheet}: USD per 1k correct answers") for sheet in SHEETS)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), sharey=True)
    markers = "osD^v<>phX*"
    for ax, (key, label) in zip(axes, panels):
        for index, (name, s) in enumerate(summaries.items()):
            ax.scatter(s[key], s["accuracy"], s=40, marker=markers[index % len(markers)], label=name, alpha=0.8)
        ax.set_xlabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(4, len(summaries)), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
