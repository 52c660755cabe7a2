"""`python -m gateway steer fit|report`: the steering commands, registered on the gateway's parser
(fitting/cli.py). The model loads only when a command runs: `--help` needs neither it nor the
`fitting` extra."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from adapters.model_files import ModelFileError
from adapters.steering import SteeringError
from fitting.extras import MissingExtra, require
from fitting.steering.prompts import PairsError, read_pairs

REFERENCE = "qwen2.5-coder-0.5b-instruct"


def register(commands: argparse._SubParsersAction) -> None:
    """Add `steer` (with its `fit` and `report` subcommands, each setting `run=`) to `commands`."""
    steer = commands.add_parser("steer", help="fit steering vectors and read out where a concept is steerable")
    actions = steer.add_subparsers(required=True)
    fit = actions.add_parser("fit", help="contrast pairs (JSONL) in, a steering vector file out")
    _common(fit)
    fit.add_argument("--pairs", required=True, help='JSONL of {"positive": ..., "negative": ...} (docs/steering.md)')
    fit.add_argument("--method", choices=["mean", "pca"], default="mean",
                     help="mean difference, or the first principal direction of the differences (default: mean)")
    fit.add_argument("--concept", help="the concept's name, recorded in the file (default: the pairs file's stem)")
    fit.add_argument("--out", required=True, help="the vector file to write (.npz)")
    fit.set_defaults(run=_fit)
    report = actions.add_parser("report", help="per-layer probe accuracy, cosines between concepts, a heatmap")
    _common(report)
    report.add_argument("--pairs", required=True, nargs="+", help="one or two concepts' pairs files (JSONL)")
    report.add_argument("--folds", type=int, default=5, help="cross-validation folds of pairs (default: 5)")
    report.add_argument("--limit", type=int, help="read only each file's first LIMIT pairs")
    report.add_argument("--out", required=True, help="directory for report.json and heatmap.png")
    report.add_argument("--no-heatmap", dest="heatmap", action="store_false",
                        help="write report.json only: no heatmap.png, which needs matplotlib (the fitting extra)")
    report.set_defaults(run=_report)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=REFERENCE, help=f"catalog name or GGUF path (default: {REFERENCE})")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default: 1)")


def _fit(args: argparse.Namespace) -> int:
    from fitting.steering.fit import fit, open_model

    try:
        pairs = read_pairs(args.pairs)
        with open_model(args.model, args.threads) as model:
            vector = fit(model, pairs, args.method, {"concept": args.concept or Path(args.pairs).stem,
                                                     "command": _command()})
    except (PairsError, ModelFileError, SteeringError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    vector.save(args.out)
    norms = ", ".join(f"{n:.1f}" for n in (vector.directions ** 2).sum(axis=1) ** 0.5)
    print(f"{args.out}: {vector.n_layer} layers x {vector.n_embd} from {len(pairs)} pairs ({args.method}); "
          f"lengths per layer: {norms}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from fitting.steering.fit import open_model
    from fitting.steering.report import Report, readout, table, write

    if len(args.pairs) > 2:
        print("error: --pairs takes one or two concepts", file=sys.stderr)
        return 2
    try:
        if args.heatmap:  # before the model loads: the picture is drawn last
            require("matplotlib", "steer report's heatmap.png", instead="pass --no-heatmap")
        concepts = [(Path(path).stem, read_pairs(path)[:args.limit]) for path in args.pairs]
        with open_model(args.model, args.threads) as model:
            report = Report.of([readout(model, pairs, name, args.folds) for name, pairs in concepts])
    except (PairsError, ModelFileError, MissingExtra) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(report))
    for path in write(report, args.out, {"local_model": args.model, "command": _command()}, heatmap=args.heatmap):
        print(f"wrote {path}")
    return 0


def _command() -> str:
    return "python -m gateway " + shlex.join(sys.argv[1:])


def main(argv: list[str] | None = None) -> int:
    """`python -m fitting.steering.cli steer ...`: the same commands without the gateway's parser."""
    parser = argparse.ArgumentParser(prog="python -m fitting.steering.cli")
    register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
