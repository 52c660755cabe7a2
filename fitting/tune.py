"""`python -m gateway tune`: fit an alias's answer-level routing to the user's own prompts.

One code path with `python -m eval`: the prompts decode through the runner both use (fitting/runner.py:
the gateway's real decoder, the local model in-process, the alias's upstream over HTTP) into a
run directory as eval's, resumably; the answer check is fitted as `eval answer-check` fits it
(fitting/afresh.py), candidates are derived as `eval afresh` derives them, and costs come from
fitting/costs.py. The steps:

1. decode `local`, `upstream` and `local,agree=K` answers of every fit, choose and report row
   (a progress bar with a time estimate; a rerun skips what is recorded);
2. label each local answer: right or wrong against its reference, else by agreement with the
   upstream-only answer (fitting/tune_fit.py `relabel`; the report says which);
3. fit the answer check on the fit rows' local answers (stamped with the local model's sha256)
   and, with `handoff_shares`, entropy thresholds that route those shares of their steps
   (fitting/tune_thresholds.py), then decode `entropy@T` on the choose and report rows;
4. choose on the choose rows, by a rule fixed before (fitting/tune_fit.py `choose`);
5. report the choice, local only and upstream-only on the report rows (fitting/tune_report.py), and
   write the check file, tune.json, tune-report.md and alias.yaml (the alias's routing) to `out`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from adapters.model_files import model_sha256
from adapters.upstream import prices_of
from fitting.afresh import confidences_of, fit
from fitting.analysis import auroc
from fitting.configs import ConfigSpec, parse_config
from fitting.costs import SHEETS_BY_NAME, PriceSheet, load_sheet
from fitting.datasets import MAX_TOKENS, Item, load_items, parse_rows
from fitting.prompts import DATASET, labelled, load_prompts, max_tokens
from fitting.records import append_invocation, read_records, records_path, write_json
from fitting.runner import RunPlan, pending, run
from fitting.session import ModelOptions, Models, open_models
from fitting.tune_fit import Choice, candidates, choose, figures, relabel
from gateway.runtime import make_upstream
from gateway.settings import Settings, SettingsError, load_settings
from policies.answer_check import AnswerCheck

CHECK_FILE, REPORT_FILE, SNIPPET_FILE, RESULT_FILE = "answer-check.json", "tune-report.md", "alias.yaml", "tune.json"
SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # of the fit answers to ask afresh: the check's candidates


@dataclass(frozen=True)
class TuneOptions:
    """What `gateway tune` was asked: an alias of a config, prompts (a prompts JSONL, or one of
    eval's datasets with `dataset`), the rows to fit, choose and report on (all three or none:
    then 40% / 20% / 40% of the rows in file order), and where to write."""

    config: Path
    alias: str
    out: Path
    prompts: Path | None = None
    dataset: str | None = None  # an eval dataset name instead of a prompts file (`prompts`: its file)
    fit_rows: str | None = None
    choose_rows: str | None = None
    report_rows: str | None = None
    agree: int = 4  # samples of the agreement check's candidates (0: none decoded)
    handoff_shares: tuple[float, ...] = ()  # shares of steps for token-level candidates (entropy@T)
    shares: tuple[float, ...] = SHARES
    max_cost_ratio: float = 0.7
    sheet: str | None = None  # a price sheet instead of the alias's upstream prices
    threads: int = 1
    parallel: int = 1
    max_tokens: int | None = None
    n_ctx: int = 2048
    command: str = "python -m gateway tune"
    progress: bool = True


@dataclass
class TuneResult:
    dataset: str
    splits: dict[str, str]
    labels: str
    sheet: PriceSheet
    sheet_note: str
    check: AnswerCheck | None
    check_quality: dict[str, float]
    choice: Choice
    report: dict[str, dict[str, Any]]  # local, upstream, the choice and every other candidate on report rows
    routing: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[float, float] = field(default_factory=dict)  # share of steps -> entropy threshold


def tune(options: TuneOptions) -> TuneResult:
    """Decode what is missing, fit, choose and report; write the files. SettingsError, ValueError
    (bad options, prompts or rows) and RuntimeError (the upstream failed: rerun to resume)."""
    from fitting.tune_report import write_outputs

    settings = load_settings(options.config)
    _check_alias(settings, options.alias)
    dataset, items = tune_items(options)
    splits = resolve_splits(options, len(items))
    parts = {name: _in_rows(items, rows) for name, rows in splits.items()}
    _check_disjoint(parts)
    chosen_ids = {item.id for part in parts.values() for item in part}
    wanted = [item for item in items if item.id in chosen_ids]
    plan = RunPlan(dataset, wanted, _configs(options.agree), options.out, _max_tokens(options, dataset, wanted),
                   parallel=options.parallel)
    decode(plan, settings, options)
    thresholds = fit_thresholds(settings, options, dataset, parts["fit"])
    if thresholds:
        fit_ids = {item.id for item in parts["fit"]}
        later = [item for item in wanted if item.id not in fit_ids]
        decode(RunPlan(dataset, later, [parse_config(name) for name in _routed(thresholds)], options.out,
                       plan.max_tokens, parallel=options.parallel), settings, options)
    result = decide(settings, options, dataset, parts, splits, thresholds)
    write_outputs(result, options)
    return result


def tune_items(options: TuneOptions) -> tuple[str, list[Item]]:
    """(the dataset name the records go under, every item of the prompts)."""
    if options.dataset:
        return options.dataset, load_items(options.dataset, options.prompts)
    if options.prompts is None:
        raise ValueError("give --prompts FILE (a prompts JSONL: docs/tuning.md) or --dataset NAME")
    return DATASET, load_prompts(options.prompts)


def resolve_splits(options: TuneOptions, n: int) -> dict[str, str]:
    """The fit, choose and report row ranges: as given (all three), else 40% / 20% / 40% in file order."""
    given = (options.fit_rows, options.choose_rows, options.report_rows)
    if all(given):
        return dict(zip(("fit", "choose", "report"), given))
    if any(given):
        raise ValueError("give all of --fit-rows, --choose-rows and --report-rows, or none")
    if n < 5:
        raise ValueError(f"{n} prompts are too few to fit, choose and report on")
    a, b = round(n * 0.4), round(n * 0.6)
    return {"fit": f"0:{a}", "choose": f"{a}:{b}", "report": f"{b}:{n}"}


def _in_rows(items: list[Item], rows: str) -> list[Item]:
    return items[parse_rows(rows)]


def fit_thresholds(settings: Settings, options: TuneOptions, dataset: str, fit_items: list[Item]) -> dict[float, float]:
    """Entropy thresholds for `options.handoff_shares` of the fit rows' local answer steps ({}: none asked)."""
    if not options.handoff_shares:
        return {}
    from fitting.tune_thresholds import analysed_local, entropy_thresholds

    local = read_records(records_path(options.out, dataset, "local"))
    gguf = settings.models.local[settings.aliases[options.alias].local].gguf
    analysed = analysed_local(options.out, dataset, fit_items, local, gguf, options.threads, options.n_ctx)
    return entropy_thresholds(analysed, options.handoff_shares)


def _routed(thresholds: dict[float, float]) -> list[str]:
    return [f"entropy@{threshold:g}" for threshold in sorted(set(thresholds.values()))]


def _check_disjoint(parts: dict[str, list[Item]]) -> None:
    seen: dict[str, str] = {}
    for name, items in parts.items():
        if not items:
            raise ValueError(f"the {name} rows hold no prompts")
        for item in items:
            if item.id in seen:
                raise ValueError(f"prompt {item.id} is in both the {seen[item.id]} and the {name} rows")
            seen[item.id] = name


def _check_alias(settings: Settings, alias: str) -> None:
    if alias not in settings.aliases:
        raise SettingsError(f"no alias {alias!r} in the config; it has {', '.join(settings.aliases)}")
    if settings.aliases[alias].upstream is None:
        raise SettingsError(f"alias {alias!r} has no upstream: there is nothing to route to")


def _configs(agree: int) -> list[ConfigSpec]:
    names = ["local", "upstream", *([f"local,agree={agree}"] if agree else [])]
    return [parse_config(name) for name in names]


def _max_tokens(options: TuneOptions, dataset: str, items: list[Item]) -> int:
    if options.max_tokens:
        return options.max_tokens
    return max_tokens(items) if dataset == DATASET else MAX_TOKENS[dataset]


# -- decoding --

def decode(plan: RunPlan, settings: Settings, options: TuneOptions) -> None:
    """Decode every (config, item) of `plan` not yet recorded in its run directory."""
    total = sum(len(ids) for ids in pending(plan).values())
    print(f"{plan.dataset}: {len(plan.items)} prompts x {len(plan.configs)} configs, {total} answers to decode "
          f"-> {plan.run_dir}")
    if not total:
        return
    append_invocation(plan.run_dir, {"command": options.command, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                     "alias": options.alias, "config": str(options.config),
                                     "configs": [s.name for s in plan.configs], "max_tokens": plan.max_tokens,
                                     "threads": options.threads})
    asyncio.run(_decode(plan, settings, options, total))


async def _decode(plan: RunPlan, settings: Settings, options: TuneOptions, total: int) -> None:
    models = await open_alias_models(settings, options.alias, options)
    try:
        with tqdm(total=total, unit="answer", mininterval=2.0, dynamic_ncols=True, disable=not options.progress) as bar:
            def advance(name: str) -> None:
                bar.set_postfix_str(name, refresh=False)
                bar.update()
            await run(plan, models, advance)
    finally:
        models.close()


async def open_alias_models(settings: Settings, alias: str, options: TuneOptions) -> Models:
    """The alias's local model (its gguf, `options.threads`) and upstream: a launched one is started
    as eval starts one (llama-server in tokens mode), any other is reached as the gateway reaches it."""
    entry = settings.aliases[alias]
    local, upstream = settings.models.local[entry.local], settings.upstreams[entry.upstream]
    launch = upstream.launch
    model_options = ModelOptions(local.gguf, launch.gguf if launch else "", options.n_ctx, options.threads,
                                 parallel=options.parallel,
                                 upstream_server=launch.server if launch else "llama-server")
    if launch is not None:
        return await open_models(model_options, with_upstream=True)
    models = await open_models(model_options, with_upstream=False)
    models.upstream = make_upstream(entry.upstream, upstream)
    return models


# -- deciding --

def alias_sheet(settings: Settings, alias: str, override: str | None = None) -> tuple[PriceSheet, str]:
    """The price sheet costs are compared on, and a line saying where it came from: `override`, else
    the alias's upstream's token prices, else (an upstream without prices) its compute time."""
    if override:
        sheet = load_sheet(override)
        return sheet, f"price sheet {sheet.name} (--sheet): {sheet.source or sheet}"
    upstream = settings.aliases[alias].upstream
    prices = prices_of(settings.upstreams[upstream])
    if prices.free:
        sheet = SHEETS_BY_NAME["self-hosted"]
        return sheet, f"upstream '{upstream}' has no token prices: priced by its compute time ({sheet.source})"
    sheet = PriceSheet(f"alias:{upstream}", prices.input * 1e6, prices.cached_input * 1e6, prices.output * 1e6,
                       None if prices.cache_write is None else prices.cache_write * 1e6, prices.cache_min_prompt_tokens)
    return sheet, (f"upstream '{upstream}' prices, USD per million tokens: input {sheet.input:g}, cached "
                   f"{sheet.cached_read:g}, output {sheet.output:g}")


def decide(settings: Settings, options: TuneOptions, dataset: str, parts: dict[str, list[Item]],
           splits: dict[str, str], thresholds: dict[float, float] | None = None) -> TuneResult:
    """Label the recorded answers, fit the check on the fit rows, choose on the choose rows and
    measure on the report rows (no decoding)."""
    sheet, note = alias_sheet(settings, options.alias, options.sheet)
    local_gguf = settings.models.local[settings.aliases[options.alias].local].gguf
    routed = _routed(thresholds or {})
    by_part = {name: _records(options, dataset, items, routed) for name, items in parts.items()}
    every = [item for items in parts.values() for item in items]
    labels = _labels(every)
    check = _fit_check(by_part["fit"]["local"], options, model_sha256(local_gguf), splits, labels)
    quality = {name: _auroc(check, found["local"]) for name, found in by_part.items()} if check else {}
    on_choose = candidates(by_part["choose"]["local"], by_part["choose"]["upstream"], check,
                           by_part["choose"]["agree"], options.agree)
    on_choose.update((name, by_part["choose"][name]) for name in routed)
    choice = choose(on_choose, by_part["choose"]["upstream"], sheet, options.max_cost_ratio)
    report = by_part["report"]
    on_report = candidates(report["local"], report["upstream"], check, report["agree"], options.agree)
    on_report.update((name, report[name]) for name in routed)
    on_report["upstream"] = report["upstream"]
    measured = {name: figures(found, on_report["local"], report["upstream"], sheet)
                for name, found in on_report.items()}
    meta = {"alias": options.alias, "local": local_gguf, "local_sha256": model_sha256(local_gguf),
            "upstream": settings.upstreams[settings.aliases[options.alias].upstream].model, "command": options.command}
    return TuneResult(dataset, splits, labels, sheet, note, check, quality, choice, measured,
                      routing_for(choice.name, options, check is not None), meta, dict(thresholds or {}))


def _records(options: TuneOptions, dataset: str, items: list[Item],
             routed: Sequence[str] = ()) -> dict[str, list[dict[str, Any]]]:
    """The part's local, upstream, agreement and `routed` records (those on the items upstream-only
    answered), relabelled where there is no reference."""
    ids = {item.id: item for item in items}
    names = {"local": "local", "upstream": "upstream", "agree": f"local,agree={options.agree}",
             **{name: name for name in routed}}
    found = {key: [r for r in read_records(records_path(options.out, dataset, name)) if r["id"] in ids]
             for key, name in names.items()}
    upstream = [{**r, "correct": True} if not labelled(ids[r["id"]]) else r for r in found["upstream"]]
    return {"local": relabel(found["local"], upstream, ids), "upstream": upstream,
            "agree": relabel(found["agree"], upstream, ids) if options.agree else [],
            **{name: relabel(found[name], upstream, ids) for name in routed}}


def _labels(items: list[Item]) -> str:
    with_reference = sum(labelled(item) for item in items)
    if with_reference == len(items):
        return "reference"
    return "agreement" if with_reference == 0 else f"mixed: {with_reference} of {len(items)} with a reference"


def _fit_check(local: list[dict[str, Any]], options: TuneOptions, sha: str, splits: dict[str, str],
               labels: str) -> AnswerCheck | None:
    """The answer check fitted on the fit rows' local answers; None where they are all right or all wrong."""
    if len({bool(r["correct"]) for r in local}) < 2:
        return None
    meta = {"command": options.command, "alias": options.alias, "fit_rows": splits["fit"], "labels": labels,
            "prompts": str(options.prompts or options.dataset)}
    return fit(local, options.shares, sha, meta)


def _auroc(check: AnswerCheck, records: list[dict[str, Any]]) -> float:
    labels = [bool(r["correct"]) for r in records]
    if len(set(labels)) < 2:
        return math.nan
    return auroc(confidences_of(check, records), labels)


def routing_for(name: str, options: TuneOptions, fitted: bool) -> dict[str, Any]:
    """The alias's `routing:` that serves candidate `name` (eval config names, fitting/tune_fit.py)."""
    spec = parse_config(name)
    if spec.policy == "entropy":
        return {"policy": "entropy", "threshold": spec.value}
    routing: dict[str, Any] = {"policy": "never"}
    if spec.escalate_below is None:
        return routing
    if spec.agree:
        check = {"kind": "agreement", "samples": spec.agree, **({"answer": spec.keep} if spec.keep != "greedy" else {})}
        return {**routing, "answer_check": check, "escalate_below": spec.escalate_below}
    if not fitted:
        raise ValueError(f"{name} needs the fitted answer check")
    return {**routing, "answer_check": str(options.out / CHECK_FILE), "escalate_below": spec.escalate_below}


def save_result(result: TuneResult, path: Path) -> None:
    """tune.json: what was chosen and every figure behind it."""
    write_json(path, {"meta": result.meta, "dataset": result.dataset, "splits": result.splits,
                      "labels": result.labels, "sheet": result.sheet.name, "sheet_note": result.sheet_note,
                      "check_auroc": result.check_quality, "choice": {"name": result.choice.name,
                                                                      "rule": result.choice.rule,
                                                                      "candidates": result.choice.table},
                      "report": result.report, "routing": result.routing,
                      "router_thresholds": {f"{share:g}": t for share, t in result.thresholds.items()}})
