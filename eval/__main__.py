"""Command line: `python -m eval run|analyze|diverge|calibrate|thresholds|answer-check|afresh|report|costs|borrow`.
The only place that reads argv (docs/evaluation.md; the studies' own command lines are under eval/studies/).

    python -m eval run --dataset csqa --rows 0:200 --run-name ref --configs local upstream entropy@1.0 oracle
    python -m eval analyze --dataset csqa --run-name ref
    python -m eval calibrate --dataset csqa --run-name ref --fit-rows 200:300 --eval-rows 0:200 --share 0.1 0.3
    python -m eval report --dataset csqa --run-name ref --rows 0:200 --plot docs/csqa.png
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from fitting.datasets import DEFAULT_FILES, MAX_TOKENS, load_items, parse_rows
from fitting.records import RECORDED_FLASH_ATTN, RUNS_DIR, analysis_path, parse_source

if TYPE_CHECKING:  # numpy and the routers load only for the commands that use them
    import numpy as np

    from policies.learned import Router
    from policies.mlp_router import MlpRouter

LOCAL, UPSTREAM = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    try:
        return args.command(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(required=True)

    run = commands.add_parser("run", help="decode a dataset under several configs (resumable)")
    _common(run)
    _engine(run)
    run.add_argument("--configs", nargs="*", default=[], help="local, upstream, oracle, <policy>@<value>")
    run.add_argument("--configs-from", type=Path, help="a `calibrate` snippet: run each of its routings")
    run.add_argument("--configs-keys", nargs="*", help="only these entries of the --configs-from snippet")
    run.add_argument("--parallel", type=int, default=1,
                     help="items decoded at once in the local model's batched engine (default 1)")
    run.add_argument("--upstream", default=UPSTREAM, help=f"upstream model (default {UPSTREAM})")
    run.add_argument("--upstream-api-base", help="use this running /v1 completions server instead of launching one")
    run.add_argument("--upstream-server", default="llama-server", choices=["llama-server", "llama-cpp-python"],
                     help="the launched upstream: llama-server in tokens mode (default; hand-offs extend one cached "
                          "sequence) or llama-cpp-python's server in completions mode (text prompts)")
    run.add_argument("--router", help="learned router file for learned@S configs (python -m eval calibrate --learn)")
    run.add_argument("--check", help="answer check file for afresh=P configs (python -m eval answer-check)")
    run.add_argument("--warm", action="store_true", help="tokens mode: send each prompt to the upstream as an item starts")
    run.add_argument("--max-tokens", type=int, help=f"answer length limit (default {MAX_TOKENS})")
    run.add_argument("--block", type=int, default=25, help="summary.json is rewritten every this many items")
    run.add_argument("--n-ctx", type=int, default=2048)
    run.add_argument("--input-usd-per-mtok", type=float, default=0.5, help="assumed upstream price (prompt)")
    run.add_argument("--output-usd-per-mtok", type=float, default=1.5, help="assumed upstream price (completion)")
    run.add_argument("--system", type=Path, help="put every question behind this file's text as the system message; "
                     "each answer's upstream calls find it cached, as a provider's prompt cache would hold it")
    run.add_argument("--steer", help="steering vector file (python -m gateway steer fit) for the local engine")
    run.add_argument("--steer-scale", type=float, default=1.0, help="the vector's scale (default 1)")
    run.add_argument("--steer-layers", type=int, nargs=2, metavar=("FIRST", "LAST"),
                     help="layers it steers, inclusive (default: 1 to the last)")
    run.add_argument("--decision-sheet", help="price the upstream with this sheet instead (a name of `costs "
                     "--sheet` or a file; token prices only): what price-aware configs (value=, ceiling=) decide on")
    run.set_defaults(command=_run)

    analyze = commands.add_parser("analyze", help="FS-GEN: teacher-force the local model on the upstream's answers")
    _common(analyze)
    analyze.add_argument("--n-ctx", type=int, default=1024)
    analyze.add_argument("--answers", default="upstream",
                         help="whose answers to teacher-force: upstream (the FS-GEN analysis) or local (the local "
                              "model's own text, for `thresholds`)")
    analyze.set_defaults(command=_analyze)

    diverge = commands.add_parser("diverge", help="R2R's divergent labels: mismatches that change the prediction")
    _common(diverge)
    _engine(diverge)
    diverge.add_argument("--max-tokens", type=int, help=f"answer length of the roll-outs (default {MAX_TOKENS})")
    diverge.add_argument("--parallel", type=int, default=4, help="roll-outs decoded at once")
    diverge.add_argument("--n-ctx", type=int, default=2048)
    diverge.set_defaults(command=_diverge)

    calibrate = commands.add_parser("calibrate", help="thresholds for a target upstream share or token accuracy")
    _where(calibrate)
    calibrate.add_argument("--fit-rows", required=True, help="rows to fit on, e.g. 200:300")
    calibrate.add_argument("--eval-rows", help="held-out rows to report on, e.g. 0:200")
    calibrate.add_argument("--policies", nargs="+", default=["entropy", "top1", "margin"])
    calibrate.add_argument("--share", nargs="*", type=float, default=[], help="target upstream shares")
    calibrate.add_argument("--accuracy", nargs="*", type=float, default=[], help="target token accuracies")
    calibrate.add_argument("--local", default=LOCAL, help=f"the analysed local model, for --learn (default {LOCAL})")
    calibrate.add_argument("--label", choices=["mismatch", "divergent"], default="mismatch",
                           help="--learn's label: every mismatch, or only those that change the prediction "
                                "(python -m eval diverge first)")
    calibrate.add_argument("--learn", type=Path, metavar="ROUTER_JSON",
                           help="also train a learned router on the fit rows and write it here; prints it against "
                                "the threshold rules at equal share on the held-out rows")
    calibrate.add_argument("--out", type=Path, help="snippet path (default <run>/calibrated_<dataset>.yaml)")
    calibrate.set_defaults(command=_calibrate)

    thresholds = commands.add_parser("thresholds", help="refit a router's thresholds on the local model's own "
                                                        "answers of a task (python -m eval analyze --answers local)")
    _where(thresholds)
    thresholds.add_argument("--router", type=Path, required=True, help="the router file to refit")
    thresholds.add_argument("--fit-rows", required=True, help="rows to fit on, e.g. 100:200")
    thresholds.add_argument("--share", nargs="+", type=float, required=True, help="target upstream shares")
    thresholds.add_argument("--out", type=Path, required=True, help="the refitted router file")
    thresholds.add_argument("--data", type=Path, help="(mlp routers) the dataset file the run answered")
    thresholds.add_argument("--local", default=LOCAL, help="(mlp routers) the local model that teacher-forces")
    thresholds.add_argument("--threads", type=int, default=1, help="(mlp routers) llama.cpp threads")
    thresholds.set_defaults(command=_thresholds)

    check = commands.add_parser("answer-check", help="fit an answer check on a run's local answers (which of them "
                                                     "to ask the upstream afresh)")
    _where(check)
    check.add_argument("--fit-rows", help="rows to fit on (default: every local answer of the run)")
    check.add_argument("--share", nargs="+", type=float, required=True,
                       help="shares of the fit answers to ask afresh: the file records escalate_below for each")
    check.add_argument("--also", action="append", default=[], metavar="DATASET,RUN[,ROWS]",
                       help="fit on another run's local answers too (one check for mixed traffic); repeat")
    check.add_argument("--local", default=LOCAL, help=f"the local model that wrote the answers (default {LOCAL})")
    check.add_argument("--at-tokens", type=int, help="fit on each answer's first K tokens: the gateway rates answers "
                       "once they have K tokens (needs `python -m eval analyze --answers local` of each run)")
    check.add_argument("--out", type=Path, required=True, help="the answer check file to write")
    check.set_defaults(command=_answer_check)

    afresh = commands.add_parser("afresh", help="derive <base>,afresh=P records from a run's <base> and upstream "
                                                "records (no decoding), and print how the check ranks its answers")
    _where(afresh)
    afresh.add_argument("--check", type=Path, required=True,
                        help="the answer check file, or 'agreement': each base record's own agreement (local,agree=K)")
    afresh.add_argument("--below", nargs="*", type=float, default=[], help="escalate_below values (P)")
    afresh.add_argument("--at-shares", action="store_true", help="also at the check's escalate_below for each share "
                                                                 "it was fitted for")
    afresh.add_argument("--against", help="a run that decoded the same configs: count the answers both agree on")
    afresh.add_argument("--rows", help="only these dataset rows, e.g. 50:200")
    afresh.add_argument("--base", default="local", help="the config whose answers are checked (default local)")
    afresh.add_argument("--from-run", help="read local/base and upstream records from this run (default --run-name)")
    afresh.set_defaults(command=_afresh)

    report = commands.add_parser("report", help="markdown table and plot from finished runs")
    _where(report)
    report.add_argument("--rows", help="only these dataset rows, e.g. 0:200")
    report.add_argument("--data", type=Path, help="the dataset file the run used (default: data/)")
    report.add_argument("--configs", nargs="*", default=[], help="only these configs (default all)")
    report.add_argument("--all-items", action="store_true", help="do not restrict configs to their common items")
    report.add_argument("--match-policy", default="entropy", help="query-level points match this policy's shares")
    report.add_argument("--paired", nargs="?", const="local", metavar="BASE",
                        help="also a table of each config against BASE (default local) on the same questions")
    report.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    report.add_argument("--costs", action="store_true",
                        help="also cost per correct answer under three price sheets (fitting/costs.py)")
    report.add_argument("--costs-plot", type=Path, help="write cost per correct answer against accuracy here (PNG)")
    report.add_argument("--title", default=None)
    report.set_defaults(command=_report)

    costs = commands.add_parser("costs", help="re-price a run's records on price sheets, per correct answer")
    _where(costs)
    costs.add_argument("--sheet", action="append", required=True,
                       help="a built-in sheet (deepseek, frontier-openai, frontier-anthropic, self-hosted) or a "
                            "YAML/JSON file of fitting.costs.PriceSheet fields; repeat for several")
    costs.add_argument("--rows", help="only these dataset rows, e.g. 0:200")
    costs.add_argument("--configs", nargs="*", default=[], help="only these configs (default all)")
    costs.add_argument("--baseline", default="upstream", help="the config every cost is compared with")
    costs.add_argument("--shared-prefix", type=int, default=0,
                       help="model every question behind one cached system prompt of this many tokens")
    costs.add_argument("--answer-oracle", action="store_true",
                       help="add two choices that read the gold answer (fitting.costs.answer_oracles): a perfect check "
                            "of the local answer, and one knowing the upstream's answer too (needs the run's local "
                            "and upstream records)")
    costs.add_argument("--plot", type=Path, help="write accuracy against cost per correct answer here (PNG)")
    costs.add_argument("--title", default=None, help="the plot's title")
    costs.set_defaults(command=_costs)

    borrow = commands.add_parser("borrow", help="refer to another run's records of some configs instead of "
                                                "copying them (fitting/records.py, borrowed.json)")
    _where(borrow)
    borrow.add_argument("--from-run", required=True, help="the run whose records to refer to")
    borrow.add_argument("--configs", nargs="+", required=True, help="the configs whose records to refer to")
    borrow.set_defaults(command=_borrow)
    return parser


def _where(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True, choices=[*DEFAULT_FILES, "humaneval"])
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR)


def _engine(parser: argparse.ArgumentParser) -> None:
    """Options of the local model's engine, for the commands that decode with it."""
    parser.add_argument("--flash-attn", action=argparse.BooleanOptionalAction,
                        default=RECORDED_FLASH_ATTN,
                        help="llama.cpp's flash attention in the local engine (off, as the recorded runs but "
                             "price_mixed_gsm8k_draft decoded; the gateway serves with it on)")


def _common(parser: argparse.ArgumentParser) -> None:
    _where(parser)
    parser.add_argument("--data", type=Path, help="a JSONL of the same shape (default: data/)")
    parser.add_argument("--rows", help="dataset rows, e.g. 0:200 (default all)")
    parser.add_argument("--local", default=LOCAL, help=f"local model (default {LOCAL})")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per model")


# -- run --

def _run(args: argparse.Namespace) -> int:
    from fitting.configs import configs_from_snippet, ordered, parse_config
    from fitting.records import append_invocation
    from fitting.runner import RunPlan, pending

    specs = [parse_config(c) for c in args.configs]
    if args.configs_from:
        specs += configs_from_snippet(args.configs_from, args.configs_keys)
    if not specs:
        raise ValueError("no configs: give --configs and/or --configs-from")
    items = load_items(args.dataset, args.data, args.rows)
    if args.system:
        system = {"role": "system", "content": args.system.read_text(encoding="utf-8")}
        items = [dataclasses.replace(item, messages=[system, *item.messages]) for item in items]
    run_dir = args.runs_dir / args.run_name
    max_tokens = args.max_tokens or MAX_TOKENS[args.dataset]
    plan = RunPlan(args.dataset, items, ordered(specs), run_dir, max_tokens, args.block, args.parallel)
    todo = pending(plan)
    total = sum(len(ids) for ids in todo.values())
    print(f"{args.dataset}: {len(items)} items x {len(plan.configs)} configs, {total} to decode -> {run_dir}")
    if total:
        append_invocation(run_dir, _meta(args, plan))
        summary = asyncio.run(_run_async(args, plan, total))
        _print_summary(summary.get(args.dataset, {}), [s.name for s in plan.configs])
    return 0


async def _run_async(args: argparse.Namespace, plan: Any, total: int) -> dict[str, Any]:
    from fitting.costs import load_sheet
    from fitting.runner import run
    from fitting.session import ModelOptions, open_models

    _quiet_unclosed_sessions()
    options = ModelOptions(args.local, args.upstream, args.n_ctx, args.threads, args.input_usd_per_mtok,
                           args.output_usd_per_mtok, upstream_api_base=args.upstream_api_base,
                           parallel=args.parallel, upstream_server=args.upstream_server, warm=args.warm,
                           router=args.router, check=args.check, flash_attn=args.flash_attn, steering=_steering(args),
                           sheet=load_sheet(args.decision_sheet) if args.decision_sheet else None)
    models = await open_models(options, with_upstream=any(s.uses_upstream for s in plan.configs))
    try:
        if args.system and models.server is not None:
            shared = await models.share_prefix(plan.items[0].messages[0])
            print(f"upstream: every answer starts with the system prompt's {shared} tokens cached")
        with tqdm(total=total, unit="item", mininterval=2.0, dynamic_ncols=True) as bar:
            def advance(name: str) -> None:
                bar.set_postfix_str(name, refresh=False)
                bar.update()
            return await run(plan, models, advance)
    finally:
        models.close()


def _quiet_unclosed_sessions() -> None:
    """litellm leaves aiohttp sessions for the garbage collector; asyncio reports each as an error."""
    loop = asyncio.get_running_loop()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith("Unclosed"):
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _steering(args: argparse.Namespace) -> Any:
    """The run's `--steer` vector, checked against the local model (SteeringError is a ValueError)."""
    if not args.steer:
        return None
    from adapters.model_files import model_sha256
    from adapters.steering import Steering, SteeringVector

    vector = SteeringVector.load(args.steer, model_sha256(args.local))
    return Steering(vector, args.steer_scale, tuple(args.steer_layers or (1, vector.n_layer - 1)))


def _meta(args: argparse.Namespace, plan: Any) -> dict[str, Any]:
    from adapters.model_files import CATALOG
    from eval import datasets

    def model(ref: str) -> dict[str, str]:
        entry = CATALOG.get(ref)
        return {"ref": ref, "file": entry.filename, "sha256": entry.sha256} if entry else {"ref": ref}

    return {
        "command": "python -m eval " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "python -m eval run",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dataset": args.dataset, "rows": args.rows,
        "data": str(args.data or "default"), "configs": [s.name for s in plan.configs],
        "local": model(args.local), "upstream": model(args.upstream), "threads": args.threads,
        "upstream_server": args.upstream_server, "warm": args.warm, "router": args.router, "check": args.check,
        "n_ctx": args.n_ctx, "max_tokens": plan.max_tokens, "greedy": True, "flash_attn": args.flash_attn,
        "prices_usd_per_mtok": {"input": args.input_usd_per_mtok, "output": args.output_usd_per_mtok},
        "decision_sheet": args.decision_sheet, "system": str(args.system) if args.system else None,
        "instructions": {"csqa": datasets.CSQA_INSTRUCTION, "gsm8k": datasets.GSM8K_INSTRUCTION},
        "host": {"machine": platform.machine(), "python": platform.python_version()},
    }


def _print_summary(summary: dict[str, Any], names: list[str]) -> None:
    for name in names:
        s = summary.get(name, {})
        if s.get("n"):
            print(f"  {name:28s} n={s['n']:4d} acc={s['accuracy']:.3f} share={s['upstream_share']:.3f} "
                  f"calls/q={s['upstream_calls_per_item']:.1f} tok/s={s['tokens_per_s']:.1f}")


# -- analyze --

def _analyze(args: argparse.Namespace) -> int:
    from adapters.model_files import model_sha256, resolve_model
    from fitting.analysis import TeacherForcer, summarize_analysis
    from fitting.records import append_record, read_records, records_path, write_json

    run_dir = args.runs_dir / args.run_name
    references = {r["id"]: r for r in read_records(records_path(run_dir, args.dataset, args.answers))}
    if not references:
        raise ValueError(f"no {args.answers} answers for {args.dataset} in {run_dir}: run that config first")
    out = analysis_path(run_dir, args.dataset, args.answers)
    done = {r["id"] for r in read_records(out)}
    items = [i for i in load_items(args.dataset, args.data, args.rows) if i.id in references and i.id not in done]
    if items:
        forcer = TeacherForcer.load(resolve_model(args.local, fetch=True), args.n_ctx, args.threads)
        sha = model_sha256(args.local)  # a router trained on these records is stamped with it
        try:
            for item in tqdm(items, unit="item", mininterval=2.0):
                append_record(out, {**forcer.analyze(item, references[item.id]["tokens"]), "model_sha256": sha})
        finally:
            forcer.close()
    records = read_records(out)
    if args.rows:
        from fitting.records import in_rows

        records = in_rows(records, parse_rows(args.rows))
    summary = summarize_analysis(records)
    write_json(out.with_name(f"{out.stem}{'_' + args.rows.replace(':', '-') if args.rows else ''}.json"), summary)
    print(json.dumps(summary, indent=2))
    return 0


# -- calibrate --

def _diverge(args: argparse.Namespace) -> int:
    from fitting.records import in_rows, read_records, records_path

    run_dir = args.runs_dir / args.run_name
    analysis = {r["id"]: r for r in read_records(analysis_path(run_dir, args.dataset))}
    references = {r["id"]: r for r in read_records(records_path(run_dir, args.dataset, "upstream"))}
    out = analysis_path(run_dir, args.dataset, "divergent")
    done = {r["id"] for r in read_records(out)}
    items = [i for i in load_items(args.dataset, args.data, args.rows)
             if i.id in analysis and i.id in references and i.id not in done]
    asyncio.run(_diverge_async(args, items, analysis, references, out))
    records = in_rows(read_records(out), parse_rows(args.rows)) if args.rows else read_records(out)
    mismatches = sum(r["mismatch"].count("1") for r in records)
    divergent = sum(r["divergent"].count("1") for r in records)
    print(f"{len(records)} answers: {divergent} of {mismatches} mismatches change the prediction")
    return 0


async def _diverge_async(args: argparse.Namespace, items: list[Any], analysis: dict[str, Any],
                         references: dict[str, Any], out: Path) -> None:
    from adapters.local_model import LocalModel
    from adapters.model_files import resolve_model
    from eval.divergence import divergent
    from fitting.records import append_record

    if not items:
        return
    local = await LocalModel.load(resolve_model(args.local, fetch=True), args.n_ctx, args.threads, n_batch=256,
                                  queue_limit=64, parallel=args.parallel, flash_attn=args.flash_attn)
    try:
        for item in tqdm(items, unit="item", mininterval=2.0):
            record = analysis[item.id]
            labels = await divergent(local, args.dataset, item, references[item.id]["tokens"], record["mismatch"],
                                     args.max_tokens or MAX_TOKENS[args.dataset])
            append_record(out, {"id": item.id, "row": item.row, "mismatch": record["mismatch"], "divergent": labels})
    finally:
        local.close()


def _calibrate(args: argparse.Namespace) -> int:
    from fitting.calibrate import calibrate, snippet
    from fitting.records import in_rows, read_records, write_json

    run_dir = args.runs_dir / args.run_name
    records = read_records(analysis_path(run_dir, args.dataset))
    fit = in_rows(records, parse_rows(args.fit_rows))
    held_out = in_rows(records, parse_rows(args.eval_rows)) if args.eval_rows else []
    if not fit:
        raise ValueError(f"no analysed rows {args.fit_rows} for {args.dataset}: run `python -m eval analyze` first")
    if not args.share and not args.accuracy:
        raise ValueError("give --share and/or --accuracy targets")
    found = calibrate(fit, held_out, args.policies, args.share, args.accuracy)
    header = (f"python -m eval {shlex.join(sys.argv[1:])}\n"
              f"fitted on {len(fit)} teacher-forced upstream answers (rows {args.fit_rows}); "
              f"held out: {len(held_out)} (rows {args.eval_rows}).\n"
              "Paste one `routing:` block under an alias in config.yaml; `eval run --configs-from` runs them all.")
    out = args.out or run_dir / f"calibrated_{args.dataset}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(snippet(found, args.share, header))
    write_json(out.with_suffix(".json"), [c.__dict__ for c in found])
    print("| policy | target | threshold | fit share | fit token acc | held-out share | held-out token acc |")
    print("|---|---|---|---|---|---|---|")
    for c in found:
        held = c.held_out or {}
        print(f"| {c.policy} | {c.target} {c.goal:g} | {c.threshold:g} | {c.fit['upstream_share']:.3f} "
              f"| {c.fit['token_accuracy']:.3f} | {held.get('upstream_share', float('nan')):.3f} "
              f"| {held.get('token_accuracy', float('nan')):.3f} |")
    print(f"snippet: {out}")
    if args.learn:
        _learn(args, fit, held_out)
    return 0


def _decision_us(router: Any) -> float:
    from policies import RoutingState, build_policy
    from policies.base import Signal

    policy = build_policy("learned", threshold=0.5, router=router)
    signal, state = Signal(1.2, 0.5, 0.2, 7, (0.5, 0.3, 0.1, 0.05), "word"), RoutingState()
    started = time.perf_counter()
    for _ in range(10_000):
        policy.decide(signal, state)
    return (time.perf_counter() - started) / 10_000 * 1e6


def _learn(args: argparse.Namespace, fit: list[dict[str, Any]], held_out: list[dict[str, Any]]) -> None:
    from adapters.model_files import model_sha256
    from fitting.learn import compare, comparison_table, ranking_quality, reliability_table, train
    from fitting.records import read_records

    if not args.share:
        raise ValueError("--learn needs --share targets (the router's thresholds are fitted for them)")
    if "top" not in fit[0]:
        raise ValueError("the analysis has no top-k probabilities or token kinds: rerun `python -m eval analyze` "
                         "into a fresh run directory")
    held_out_labels, mismatch_fit = "mismatch", fit
    if args.label == "divergent":
        labels = {r["id"]: r["divergent"] for r in read_records(
            analysis_path(args.runs_dir / args.run_name, args.dataset, "divergent"))}
        fit = [{**r, "mismatch": labels[r["id"]]} for r in fit if r["id"] in labels]
        if not fit:
            raise ValueError("no divergent labels for the fit rows: run `python -m eval diverge` on them first")
        if held_out and all(r["id"] in labels for r in held_out):
            held_out, held_out_labels = [{**r, "mismatch": labels[r["id"]]} for r in held_out], "divergent"
    meta = {"command": f"python -m eval {shlex.join(sys.argv[1:])}", "labels": args.label,
            "local_model": args.local, "dataset": args.dataset, "fit_rows": args.fit_rows,
            "fit_answers": len(fit)}
    router = train(fit, args.share, analysed_model(fit, model_sha256(args.local)), meta)
    args.learn.parent.mkdir(parents=True, exist_ok=True)
    args.learn.write_text(json.dumps(router.to_json(), indent=1) + "\n")
    print(f"\nrouter: {args.learn} (weights on standardised features: "
          + ", ".join(f"{name} {w:+.2f}" for name, w in zip(router.to_json()["features"], router.weights)) + ")")
    print(f"one decision (features + score) takes {_decision_us(router):.1f} us on this machine")
    if held_out:
        print(f"\nheld-out rows {args.eval_rows} ({held_out_labels} labels), AUROC: "
              + ", ".join(f"{k} {v:.3f}" for k, v in ranking_quality(router, held_out).items()))
        print(reliability_table(router, held_out, held_out_labels), end="")
        if held_out_labels == "divergent":  # the same features and rows, fitted on every mismatch instead
            on_mismatch = train(mismatch_fit, args.share, router.model_sha256, meta)
            print(f"the same router fitted on mismatch labels, AUROC on these divergent labels: "
                  f"{ranking_quality(on_mismatch, held_out)['learned']:.3f}")
        print(comparison_table(compare(router, held_out, args.share)), end="")


def analysed_model(records: list[dict[str, Any]], default: str) -> str:
    """The sha256 of the local model that analysed `records` (`default` for records analysed before
    `analyze` stamped it); ValueError if they were analysed by two models."""
    found = {r["model_sha256"] for r in records if "model_sha256" in r}
    if len(found) > 1:
        raise ValueError(f"these analysis records come from {len(found)} different local models")
    return found.pop() if found else default


def _thresholds(args: argparse.Namespace) -> int:
    from fitting.learn import with_thresholds
    from policies.learned import Router

    router = Router.load(args.router)
    x, answers = (_local_hidden_rows if router.reads_hidden else _local_analysed_rows)(args, router)
    meta = {"thresholds": {"command": f"python -m eval {shlex.join(sys.argv[1:])}", "dataset": args.dataset,
                           "fit_rows": args.fit_rows, "answers": "local", "fit_answers": answers}}
    refitted = with_thresholds(router, x, args.share, meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(refitted.to_json(), indent=1) + "\n")
    for share, threshold in sorted(refitted.shares.items()):
        was = router.shares.get(share)
        print(f"share {share:g}: threshold {threshold:.4f}" + (f" (was {was:.4f})" if was is not None else ""))
    print(f"router: {args.out}")
    return 0


def _local_analysed_rows(args: argparse.Namespace, router: Router | MlpRouter) -> tuple[np.ndarray, int]:
    """A logistic router's inputs along the local model's answers, from their analysis records."""
    from fitting.learn import matrix
    from fitting.records import in_rows, read_records

    path = analysis_path(args.runs_dir / args.run_name, args.dataset, "local")
    fit = in_rows(read_records(path), parse_rows(args.fit_rows))
    if not fit:
        raise ValueError(f"no analysed local answers for rows {args.fit_rows} in {path}: run "
                         "`python -m eval analyze --answers local` on them first")
    if "top" not in fit[0]:
        raise ValueError(f"{path} has no top-k probabilities or token kinds: rerun `python -m eval analyze` "
                         "into a fresh run directory")
    if analysed_model(fit, router.model_sha256) != router.model_sha256:
        raise ValueError(f"{args.router} was trained for another local model than the one that analysed {path}")
    return matrix(fit)[0], len(fit)


def _local_hidden_rows(args: argparse.Namespace, router: Router | MlpRouter) -> tuple[np.ndarray, int]:
    """An MLP router's inputs (FEATURES and hidden state) along the local model's recorded answers,
    teacher-forced again (eval/hidden_steps.py, cached there)."""
    from adapters.model_files import model_sha256, resolve_model
    from eval.hidden_steps import CACHE_DIR, HiddenForcer, rows_of

    if model_sha256(args.local) != router.model_sha256:
        raise ValueError(f"{args.router} was trained for another local model than {args.local}")
    loaded: list[HiddenForcer] = []

    def forcer() -> HiddenForcer:
        if not loaded:
            loaded.append(HiddenForcer.load(resolve_model(args.local), 1024, args.threads))
        return loaded[0]

    try:
        x, _, answers, ids = rows_of(forcer, args.runs_dir / args.run_name, args.dataset, args.data, args.fit_rows,
                                     CACHE_DIR, config="local")
    finally:
        for model in loaded:
            model.close()
    if not ids:
        raise ValueError(f"no local answers for rows {args.fit_rows} in run {args.run_name}")
    return x, len(ids)


def _answer_check(args: argparse.Namespace) -> int:
    import numpy as np

    from adapters.model_files import model_sha256
    from fitting.afresh import confidences_of, fit
    from fitting.analysis import auroc
    from fitting.records import in_rows, read_records, records_path

    sources = [(args.dataset, args.run_name, args.fit_rows), *(parse_source(spec) for spec in args.also)]
    records, stats = [], {}
    for dataset, run, rows in sources:
        path = records_path(args.runs_dir / run, dataset, "local")
        found = in_rows(read_records(path), parse_rows(rows)) if rows else read_records(path)
        rated = _answer_stats(args.runs_dir / run, dataset, "local", found, args.at_tokens)
        found = [r for r in found if r["id"] in rated]
        if not found:
            raise ValueError(f"no {'analysed ' if args.at_tokens else ''}local answers in {path}"
                             + (f" for rows {rows}" if rows else ""))
        records += found
        stats.update(rated)
    meta = {"command": f"python -m eval {shlex.join(sys.argv[1:])}",
            "fitted_on": [{"dataset": d, "run": r, "rows": rows or "all"} for d, r, rows in sources]}
    check = fit(records, args.share, model_sha256(args.local), meta, stats=stats, at_tokens=args.at_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(check.to_json(), indent=1) + "\n")
    labels = np.array([float(r["correct"]) for r in records])
    print(f"{len(records)} answers, {labels.mean():.1%} correct; AUROC on them "
          f"{auroc(confidences_of(check, records, stats), labels):.4f}")
    for share, below in sorted(check.shares.items()):
        print(f"ask {share:.0%} afresh: escalate_below {below:.4f}")
    print(f"answer check: {args.out}")
    return 0


def _answer_stats(run_dir: Path, dataset: str, answers: str, records: list[dict[str, Any]],
                  at_tokens: int | None) -> dict[str, Any]:
    """What a check reads of each of `records` (fitting.afresh.answer_stats); a check read at
    `at_tokens` needs the answers' analysis, and answers without one are left out."""
    from fitting.afresh import answer_stats
    from fitting.records import read_records

    analysed = {a["id"]: a for a in read_records(analysis_path(run_dir, dataset, answers))} if at_tokens else {}
    return answer_stats(records, at_tokens, analysed)


def _afresh_by_agreement(args: argparse.Namespace, source: Path, base: list, upstream: list) -> int:
    from fitting.afresh import derived
    from fitting.records import merge_records, records_path, write_records

    base = [r for r in base if r.get("agreement") is not None]
    if not base:
        raise ValueError(f"{args.base} records of {source.name} hold no agreement: run a local,agree=K config")
    for level in sorted({r["agreement"] for r in base}):  # how well the agreement ranks the answers
        at = [r for r in base if r["agreement"] == level]
        print(f"agreement {level:g}: {sum(r['correct'] for r in at)} of {len(at)} answers correct")
    run_dir = args.runs_dir / args.run_name
    if run_dir.resolve() != source.resolve():
        for name, found in ((args.base, base), ("upstream", upstream)):
            merge_records(records_path(run_dir, args.dataset, name), found)
    for below in args.below:
        name = f"{args.base},afresh={below:g}"
        records = derived(base, upstream, None, below, name)
        write_records(records_path(run_dir, args.dataset, name), records)
        print(f"{name}: {sum(r['afresh'] for r in records)} of {len(records)} asked afresh, "
              f"{sum(r['correct'] for r in records)} correct")
    return 0


def _afresh(args: argparse.Namespace) -> int:
    import numpy as np

    from fitting.afresh import agreement, confidences_of, derived
    from fitting.analysis import auroc, reliability
    from fitting.records import in_rows, merge_records, read_records, records_path, write_records
    from policies.answer_check import AnswerCheck

    source = args.runs_dir / (args.from_run or args.run_name)
    rows = parse_rows(args.rows) if args.rows else None
    base, upstream = (read_records(records_path(source, args.dataset, name)) for name in (args.base, "upstream"))
    if rows is not None:
        base, upstream = in_rows(base, rows), in_rows(upstream, rows)
    if not base or not upstream:
        raise ValueError(f"{source} needs {args.base} and upstream records of {args.dataset}")
    if str(args.check) == "agreement":  # each base record's own agreement rates it (a local,agree=K run)
        return _afresh_by_agreement(args, source, base, upstream)
    check = AnswerCheck.load(args.check)
    stats = _answer_stats(source, args.dataset, args.base, base, check.at_tokens)
    base = [r for r in base if r["id"] in stats]
    if not base:
        raise ValueError(f"{args.check} rates answers at {check.at_tokens} tokens: run `python -m eval analyze "
                         f"--answers {args.base}` on {source.name} first")
    labels, confidences = np.array([float(r["correct"]) for r in base]), confidences_of(check, base, stats)
    print(f"{len(base)} {args.base} answers, {labels.mean():.1%} correct; the check's AUROC on them "
          f"{auroc(confidences, labels):.4f}\n\n| confidence | answers | mean confidence | correct |\n|---|---|---|---|")
    for low, high, count, mean, correct in reliability(confidences, labels):
        print(f"| {low:.3f}-{high:.3f} | {count} | {mean:.3f} | {correct:.1%} |")
    print()
    run_dir = args.runs_dir / args.run_name
    if run_dir.resolve() != source.resolve():  # the base and upstream records beside the derived ones, to compare
        for name, found in ((args.base, base), ("upstream", upstream)):
            merge_records(records_path(run_dir, args.dataset, name), found)  # other rows there stay
    for below in [*args.below, *(sorted(check.shares.values()) if args.at_shares else [])]:
        name = f"{args.base},afresh={below:g}"
        records = derived(base, upstream, check, below, name, stats)
        write_records(records_path(run_dir, args.dataset, name), records)
        asked = sum(r["afresh"] for r in records)
        print(f"{name}: {asked} of {len(records)} asked afresh, {sum(r['correct'] for r in records)} correct")
        if args.against:
            decoded = read_records(records_path(args.runs_dir / args.against, args.dataset, name))
            same, compared = agreement(decoded, records)
            print(f"  decoded in {args.against}: {compared} answers, {same} with the same text as derived")
    return 0


# -- report --

def _report(args: argparse.Namespace) -> int:
    from eval.report import build_rows, load, markdown_table, paired_table, plot

    run_dir = args.runs_dir / args.run_name
    items = load_items(args.dataset, args.data) if args.dataset in ("csqa", "gsm8k") else []
    configs = load(run_dir, args.dataset, parse_rows(args.rows), args.configs, common=not args.all_items, items=items)
    if not configs:
        raise ValueError(f"no records for {args.dataset} in {run_dir}")
    rows, points = build_rows(configs, args.match_policy)
    print(markdown_table(rows), end="")
    if args.paired:
        print("\n" + paired_table(configs, base=args.paired), end="")
    n = max(r.summary["n"] for r in rows)
    title = args.title or f"{args.dataset}: {n} questions ({args.run_name})"
    if args.plot:
        plot(rows, points, args.plot, title)
        print(f"plot: {args.plot}")
    if args.costs or args.costs_plot:
        from fitting.costs import cost_plot, cost_table

        records = {name: found for name, (_, found) in configs.items()}
        print("\n" + cost_table(records), end="")
        if args.costs_plot:
            cost_plot(records, args.costs_plot, title)
            print(f"plot: {args.costs_plot}")
    return 0


def _costs(args: argparse.Namespace) -> int:
    from fitting.costs import answer_oracles, load_sheet, repriced_plot, repriced_table
    from eval.report import load

    configs = load(args.runs_dir / args.run_name, args.dataset, parse_rows(args.rows), args.configs)
    if not configs:
        raise ValueError(f"no records for {args.dataset} in {args.runs_dir / args.run_name}")
    sheets = [load_sheet(spec) for spec in args.sheet]
    for sheet in sheets:
        print(f"- {sheet.name}: {sheet.source or sheet}")
    records = {name: found for name, (_, found) in configs.items()}
    if args.answer_oracle:
        if not records.get("local") or not records.get("upstream"):
            raise ValueError("--answer-oracle needs the run's local and upstream records")
        records.update(answer_oracles(records["local"], records["upstream"]))
    print("\n" + repriced_table(records, sheets, args.baseline, args.shared_prefix), end="")
    if args.plot:
        if not records.get(args.baseline):
            raise ValueError(f"--plot prices every config against {args.baseline!r}, and the run has no such records")
        title = args.title or f"{args.dataset}, {args.run_name}"
        repriced_plot(records, sheets, args.plot, title, args.baseline, args.shared_prefix)
        print(f"plot: {args.plot}")
    return 0


def _borrow(args: argparse.Namespace) -> int:
    from fitting.records import borrow, records_path

    run_dir, source = args.runs_dir / args.run_name, args.runs_dir / args.from_run
    names = [records_path(source, args.dataset, config).name for config in args.configs]
    for name in borrow(run_dir, source, names):
        print(f"{run_dir.name}/{name}: borrowed from {source.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
