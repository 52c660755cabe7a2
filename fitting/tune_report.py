"""The files `python -m gateway tune` writes from a TuneResult (fitting/tune.py): the fitted answer
check, tune.json, tune-report.md (held-out figures with intervals) and alias.yaml (the alias's
routing, to paste into the config)."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from fitting.tune import TuneOptions, TuneResult

LABELS = {"reference": "right or wrong against each prompt's reference",
          "agreement": "no prompt has a reference: an answer counts as correct when it agrees with the upstream-only "
                       "answer (policies/agreement.py), so 'accuracy' is agreement with upstream-only, which is 100% "
                       "by definition"}


def write_outputs(result: TuneResult, options: TuneOptions) -> None:
    """Write the check (if one was fitted), tune.json, the report and the snippet into `options.out`."""
    from fitting.tune import CHECK_FILE, REPORT_FILE, RESULT_FILE, SNIPPET_FILE, save_result

    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    if result.check is not None:
        (out / CHECK_FILE).write_text(json.dumps(result.check.to_json(), indent=1) + "\n")
    save_result(result, out / RESULT_FILE)
    (out / SNIPPET_FILE).write_text(snippet(result, options))
    (out / REPORT_FILE).write_text(markdown(result, options))
    print(f"chosen: {result.choice.name} -> {out / SNIPPET_FILE}; report: {out / REPORT_FILE}")


def snippet(result: TuneResult, options: TuneOptions) -> str:
    """YAML: the alias with its tuned routing, and how it measured on the report rows."""
    figures = result.report.get(result.choice.name, {})
    header = (f"{options.command}\nchosen on rows {result.splits['choose']} ({result.choice.rule});\n"
              f"on the report rows {result.splits['report']}: accuracy {_pct(figures.get('accuracy'))}, "
              f"{_ratio(figures.get('cost_ratio'))} upstream-only's cost per correct answer ({result.sheet.name}).\n"
              "An answer asked afresh must not stream (a streamed answer is rated but kept).")
    body = {"aliases": {options.alias: {"routing": result.routing}}}
    return "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(body, sort_keys=False,
                                                                                 default_flow_style=None, width=120)


def markdown(result: TuneResult, options: TuneOptions) -> str:
    """tune-report.md: what was decoded, fitted, chosen and measured, every figure with its rows."""
    meta, splits = result.meta, result.splits
    lines = [f"# Tuning alias `{meta['alias']}`", "",
             f"`{meta['command']}`", "",
             f"- local model: `{meta['local']}` (sha256 `{meta['local_sha256'][:16]}...`); "
             f"upstream: `{meta['upstream']}`",
             f"- prompts: `{options.prompts or options.dataset}`; rows: fit {splits['fit']}, "
             f"choose {splits['choose']}, report {splits['report']} (nothing was fitted or chosen on the report rows)",
             f"- labels: {LABELS.get(result.labels, result.labels)}",
             f"- costs: {result.sheet_note}",
             f"- chosen: **`{result.choice.name}`** -> `routing: {json.dumps(result.routing)}`", "",
             "## On the report rows", "",
             *_figures_table({name: result.report[name] for name in _headline(result) if name in result.report}), "",
             "Accuracy with its Wilson 95% interval; cost per correct answer as a multiple of upstream-only's on the "
             "same rows, with a paired bootstrap 95% interval; gained / lost: right where local only is wrong and the "
             "reverse, with the exact McNemar p and the accuracy change's paired bootstrap 95% interval.", "",
             "## The choice, on the choose rows", "",
             f"Rule: {result.choice.rule}.", "",
             "| candidate | n | accuracy | asked afresh | cost per correct (x upstream-only) |",
             "|---|---|---|---|---|",
             *(f"| {'**' + row['name'] + '**' if row['name'] == result.choice.name else row['name']} | {row['n']} "
               f"| {_pct(row['accuracy'])} | {_pct(row['afresh'])} | {_ratio(row['ratio'])} |"
               for row in result.choice.table), "",
             "## The fitted answer check", "",
             *_check_lines(result), "",
             "## Router thresholds", "",
             *_threshold_lines(result), "",
             "## Every candidate on the report rows (for information: not used to choose)", "",
             *_figures_table(result.report), ""]
    return "\n".join(lines)


def _headline(result: TuneResult) -> list[str]:
    return list(dict.fromkeys([result.choice.name, "local", "upstream"]))


def _figures_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| config | n | accuracy [Wilson 95%] | asked afresh | upstream calls / answer "
             "| cost per correct (x upstream-only) [95%] | gained / lost vs local | McNemar p | change [95%] |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, f in rows.items():
        low, high = f["wilson95"]
        r_low, r_high = f["cost_ratio95"]
        c_low, c_high = f["change95"]
        lines.append(f"| {name} | {f['n']} | {_pct(f['accuracy'])} [{_pct(low)}, {_pct(high)}] | {_pct(f['afresh'])} "
                     f"| {f['upstream_calls']:.2f} | {_ratio(f['cost_ratio'])} [{_ratio(r_low)}, {_ratio(r_high)}] "
                     f"| {f['gained']} / {f['lost']} | {f['mcnemar_p']:.3g} | {_signed(f['change'])} "
                     f"[{_signed(c_low)}, {_signed(c_high)}] |")
    return lines


def _check_lines(result: TuneResult) -> list[str]:
    if result.check is None:
        return ["No check was fitted: the fit rows' local answers were all right or all wrong."]
    meta = result.check.meta
    auc = ", ".join(f"{name} rows {_num(value)}" for name, value in result.check_quality.items())
    shares = ", ".join(f"{share:.0%}: {below:g}" for share, below in sorted(result.check.shares.items()))
    return [f"`answer-check.json`, fitted on {meta.get('fit_answers')} local answers ({_pct(meta.get('fit_accuracy'))} "
            f"correct) of rows {result.splits['fit']}, for the local model's sha256 only.",
            f"AUROC (how well it ranks right above wrong answers): {auc}.",
            f"escalate_below for each share of the fit answers asked afresh: {shares}."]


def _threshold_lines(result: TuneResult) -> list[str]:
    if not result.thresholds:
        return ["No token-level candidates (`--handoff-shares` not given): answers are kept or asked afresh whole."]
    fitted = ", ".join(f"{share:g} of the steps: entropy above {t:g} nats"
                       for share, t in sorted(result.thresholds.items()))
    return [f"Fitted on the fit rows' local answers (teacher-forced again): {fitted}; each decoded as "
            "`entropy@T` on the choose and report rows, hand-offs crossing to the upstream's tokenizer."]


def _pct(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1%}"


def _signed(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:+.1%}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def _num(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"
