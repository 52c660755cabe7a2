"""One router for mixed traffic: a logistic router fitted on several tasks' answers at once, beside
a router per task, each rated on every task's held-out answers.

    python -m eval.studies.mixed.mixed_router --share 0.05 0.1 --out routers/mixed-qwen2.5-coder-0.5b.json \
        --fit csqa,router,100:300 --fit gsm8k,gsm8k_train_hidden --fit mbpp,mbpp,0:100:2 ... \
        --held-out csqa,router,0:100 --held-out gsm8k,router,0:100 --held-out humaneval,learned_humaneval ... \
        --live-fit gsm8k,gsm8k_train_local ... --live gsm8k,learned_gsm8k,100:199 ...

Sources are DATASET,RUN[,ROWS] over `python -m eval analyze`'s records. --fit and --held-out name
the upstream's answers, teacher-forced (the mismatch label); --live-fit and --live the local
model's own answers (`analyze --answers local`), the text the router reads when it serves.
Reported for each held-out task: AUROC of the mixed router, of that task's own router (fitted on
its --fit rows alone, where it has some) and of top-1. For each --live task: the share the mixed
router routes there at thresholds fitted on the --live-fit answers of every task together
(on-policy, one threshold for all traffic), beside the task's own on-policy thresholds where it
has --live-fit answers. The mixed router, with its on-policy thresholds when --live-fit is
given, is written to --out. Also for each --live task: the share routed with the threshold taken
from traffic (`threshold_from: traffic`, the quantile of recent scores), on the task's answers
alone and on all --live tasks' answers interleaved.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adapters.model_files import model_sha256
from fitting.analysis import auroc, steps
from fitting.learn import matrix, scored, step_signal, train, with_thresholds
from fitting.records import RUNS_DIR, load_analysed, write_json
from policies import RoutingState, SharedWindows, build_policy
from policies.learned import FEATURES, Router

LOCAL = "qwen2.5-coder-0.5b-instruct"
TASK_TRAFFIC, MIXED_TRAFFIC = "share (from the task's traffic)", "share (from mixed traffic)"


def _shares(scores: np.ndarray, router: Router) -> dict[str, float]:
    return {f"{share:g}": float((scores > threshold).mean()) for share, threshold in sorted(router.shares.items())}


def held_out_report(mixed: Router, own: dict[str, Router], held: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """For each held-out task: AUROC for a mismatch of the mixed router, the task's own and top-1,
    and the share the mixed router routes there at its thresholds (fitted on the mixed fit rows)."""
    report = {}
    for task, records in held.items():
        scores, labels, x = scored(mixed, records)
        found = {"mixed": auroc(scores, labels), "1-top1": auroc(-x[:, FEATURES.index("top1")], labels)}
        if task in own:
            found["own task"] = auroc(scored(own[task], records)[0], labels)
        report[task] = {"answers": len(records), "positions": int(len(labels)), "mismatch_share": float(labels.mean()),
                        "auroc": found, "share at the mixed fit thresholds": _shares(scores, mixed)}
    return report


def live_report(on_policy: Router, live_fit: dict[str, list[dict[str, Any]]], live: dict[str, list[dict[str, Any]]],
                shares: Sequence[float]) -> dict[str, Any]:
    """For each live task: the share `on_policy` routes on its local answers, the share at
    thresholds fitted on that task's own --live-fit answers alone (where it has some), and the
    share with the threshold taken from traffic: the task's answers alone, and all live tasks'
    answers arriving interleaved through one window."""
    report = {}
    mixed = {share: traffic_shares(on_policy, live, share) for share in shares}
    for task, records in live.items():
        scores = scored(on_policy, records)[0]
        found = {"answers": len(records), "positions": int(len(scores)), "share (one threshold)": _shares(scores, on_policy)}
        if task in live_fit:
            own = with_thresholds(on_policy, matrix(live_fit[task])[0], shares)
            found["share (the task's own thresholds)"] = _shares(scores, own)
        found[TASK_TRAFFIC] = {f"{s:g}": traffic_shares(on_policy, {task: records}, s)[task]
                                                    for s in shares}
        found[MIXED_TRAFFIC] = {f"{s:g}": mixed[s][task] for s in shares}
        report[task] = found
    return report


def traffic_shares(router: Router, tasks: dict[str, list[dict[str, Any]]], share: float) -> dict[str, float]:
    """The share of each task's positions that `learned` with its threshold taken from traffic
    routes when the tasks' answers arrive interleaved (one of each in turn) through one window, a
    fresh policy per answer as the gateway builds one per request. Teacher-forced: a routed step
    does not change the text after it, as it would live."""
    windows, routed = SharedWindows(), {task: [] for task in tasks}
    for turn in itertools.zip_longest(*([(task, r) for r in records] for task, records in tasks.items())):
        for task, record in filter(None, turn):
            policy = build_policy("learned", target_fraction=share, router=router, windows=windows,
                                  threshold_from="traffic")
            routed[task] += [policy.decide(step_signal(step), RoutingState()).upstream for step in steps([record])]
    return {task: float(np.mean(decisions)) for task, decisions in routed.items()}


def table(report: dict[str, Any]) -> str:
    """Markdown tables of a report: AUROC per held-out task, live shares per live task."""
    lines = ["| held-out task | answers | positions | mismatches | mixed | own task | top-1 |", "|---|---|---|---|---|---|---|"]
    for task, row in report["held_out"].items():
        found = row["auroc"]
        own = f"{found['own task']:.4f}" if "own task" in found else "-"
        lines.append(f"| {task} | {row['answers']} | {row['positions']} | {row['mismatch_share']:.1%} "
                     f"| {found['mixed']:.4f} | {own} | {found['1-top1']:.4f} |")
    if report["live"]:
        lines += ["", "| live task | answers | target share | one threshold | the task's own thresholds "
                  "| from the task's traffic | from mixed traffic |", "|---|---|---|---|---|---|---|"]
        for task, row in report["live"].items():
            for share, reached in row["share (one threshold)"].items():
                own = row.get("share (the task's own thresholds)", {}).get(share)
                lines.append(f"| {task} | {row['answers']} | {share} | {reached:.1%} | "
                             + (f"{own:.1%}" if own is not None else "-")
                             + f" | {row[TASK_TRAFFIC][share]:.1%} | {row[MIXED_TRAFFIC][share]:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="append", required=True, metavar="DATASET,RUN[,ROWS]",
                        help="teacher-forced upstream answers the routers are fitted on")
    parser.add_argument("--held-out", action="append", required=True, metavar="DATASET,RUN[,ROWS]",
                        help="teacher-forced upstream answers the routers are rated on")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    parser.add_argument("--live-fit", action="append", default=[], metavar="DATASET,RUN[,ROWS]",
                        help="the local model's answers the on-policy thresholds are fitted on")
    parser.add_argument("--live", action="append", default=[], metavar="DATASET,RUN[,ROWS]",
                        help="the local model's answers the on-policy shares are checked on")
    parser.add_argument("--share", nargs="+", type=float, default=[0.05, 0.1])
    parser.add_argument("--local", default=LOCAL, help="the analysed local model")
    parser.add_argument("--out", type=Path, help="write the mixed router here")
    parser.add_argument("--report", type=Path, default=RUNS_DIR / "mixed" / "mixed_router.json")
    args = parser.parse_args(argv)

    fit, held = load_analysed(args.fit, args.runs_dir, "upstream"), load_analysed(args.held_out, args.runs_dir, "upstream")
    live_fit, live = load_analysed(args.live_fit, args.runs_dir, "local"), load_analysed(args.live, args.runs_dir, "local")
    sha = model_sha256(args.local)
    command = "python -m eval.studies.mixed.mixed_router " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"command": command, "labels": "mismatch", "local_model": args.local,
            "fitted_on": {task: len(records) for task, records in fit.items()}}
    mixed = train([r for records in fit.values() for r in records], args.share, sha, meta)
    own = {task: train(records, args.share, sha, meta) for task, records in fit.items()}
    on_policy = with_thresholds(mixed, matrix([r for records in live_fit.values() for r in records])[0], args.share,
                                {"thresholds": {"answers": "local", "fitted_on": {t: len(r) for t, r in live_fit.items()}}}
                                ) if live_fit else mixed
    report = {"local_model_sha256": sha, "fit": {t: {"answers": len(r), "positions": int(len(matrix(r)[1]))}
                                                 for t, r in fit.items()},
              "held_out": held_out_report(mixed, own, held),
              "live": live_report(on_policy, live_fit, live, args.share) if live else {}, "command": command}
    write_json(args.report, report)
    if args.out:
        args.out.write_text(json.dumps(on_policy.to_json(), indent=1) + "\n")
    print(table(report), end="")
    print(f"report: {args.report}" + (f"; router: {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
