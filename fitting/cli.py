"""`python -m gateway tune` and `python -m gateway steer fit|report`: the fitting commands,
registered on the gateway's parser (gateway/__main__.py). Each sets `run=`; nothing heavy loads
until one runs, so `--help` needs neither a model nor the `fitting` extra."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fitting.extras import require
from fitting.steering.cli import register as steering_commands


def register(commands: argparse._SubParsersAction) -> None:
    """Add `tune` and `steer` to `commands`."""
    _tune_parser(commands)
    steering_commands(commands)


def _tune_parser(commands: argparse._SubParsersAction) -> None:
    tune = commands.add_parser("tune", help="fit an alias's routing to your own prompts (docs/tuning.md)")
    tune.add_argument("--config", default="config.yaml", help="YAML settings file holding the alias")
    tune.add_argument("--alias", help="the alias to tune (it needs an upstream)")
    tune.add_argument("--prompts", type=Path, help="a prompts JSONL (docs/tuning.md); with --dataset: its data file")
    tune.add_argument("--dataset", help="one of the harness's datasets instead (csqa, gsm8k, ifeval, humaneval, "
                                        "mbpp, ...); outside a checkout of the repository, pass its file as --prompts")
    tune.add_argument("--out", type=Path, help="where the records and the fitted files go (e.g. results/tune/NAME)")
    tune.add_argument("--fit-rows", help="rows to fit the answer check on, e.g. 0:100 (all three or none: "
                                         "then 40%% / 20%% / 40%% of the rows)")
    tune.add_argument("--choose-rows", help="rows to choose the routing on, e.g. 100:150")
    tune.add_argument("--report-rows", help="held-out rows to report on, e.g. 150:250")
    tune.add_argument("--agree", type=int, default=4, help="samples of the agreement check candidates (0: none)")
    tune.add_argument("--handoff-shares", nargs="*", type=float, default=[],
                      help="also token-level candidates: entropy thresholds routing these shares of the fit "
                           "answers' steps, decoded on the choose and report rows (e.g. 0.05 0.1)")
    tune.add_argument("--max-cost-ratio", type=float, default=0.7,
                      help="choose the most accurate routing at most this multiple of upstream-only's cost per "
                           "correct answer (default 0.7)")
    tune.add_argument("--sheet", help="price costs on this sheet (deepseek, frontier-openai, frontier-anthropic, "
                                      "self-hosted, or a file) instead of the alias's prices")
    tune.add_argument("--threads", type=int, default=1, help="llama.cpp threads, local model and launched upstream")
    tune.add_argument("--parallel", type=int, default=1, help="prompts decoded at once")
    tune.add_argument("--max-tokens", type=int, help="answer length (default: by the prompts' format)")
    tune.add_argument("--convert", metavar="DATASET", help="print a dataset's rows (csqa, gsm8k; --prompts: the "
                                                           "file, --rows) as a prompts JSONL, and stop")
    tune.add_argument("--rows", help="with --convert: the rows to print")
    tune.add_argument("--from-examples", action="store_true",
                      help="fit the alias's answer check on the examples a learning gateway (routing.learn) holds "
                           "in its Redis store instead of decoding prompts (docs/routing.md, 'Routing that learns')")
    tune.add_argument("--target", type=float, help="with --from-examples: the agreement to hold (default: the alias's "
                                                   "quality_target)")
    tune.set_defaults(run=_tune)


def _tune(args: argparse.Namespace) -> int:
    import json

    try:
        if args.convert:
            from fitting.prompts import convert

            for line in convert(args.convert, args.prompts, args.rows):
                print(json.dumps(line, ensure_ascii=False))
            return 0
        if not args.alias or not args.out:
            raise ValueError("tune needs --alias and --out (and --prompts or --dataset)")
        if args.from_examples:
            from fitting.tune_examples import REPORT_FILE, tune_from_examples

            tune_from_examples(Path(args.config), args.alias, args.out, args.target)
            print((args.out / REPORT_FILE).read_text())
            return 0
        require("tqdm", "python -m gateway tune")  # its progress bar
        from fitting.tune import TuneOptions, tune

        tune(TuneOptions(Path(args.config), args.alias, args.out, args.prompts, args.dataset, args.fit_rows,
                         args.choose_rows, args.report_rows, args.agree, tuple(args.handoff_shares),
                         max_cost_ratio=args.max_cost_ratio, sheet=args.sheet, threads=args.threads,
                         parallel=args.parallel, max_tokens=args.max_tokens,
                         command="python -m gateway " + shlex.join(sys.argv[1:])))
    except (ValueError, RuntimeError, FileNotFoundError) as exc:  # MissingExtra is a RuntimeError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

