#!/usr/bin/env bash
# Routing on a steered model (docs/steering.md, "Routing on a steered model"): CommonsenseQA rows
# 922-1,221, the reference pair, the CommonsenseQA divergent router fitted on the plain model (rows
# 200-299) at its fitted 5% threshold and at 5% from traffic, plain against the letter vector
# (scale 0.25, layers 10-14, chosen on dev rows 0-99). Nothing is chosen here. Local-only and
# upstream-only are borrowed from the steering and agreement report runs. Resumable: rerun it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
E=".venv/bin/python -m eval"
RUNS=results/steering/runs
ROUTED="--dataset csqa --data data/commonsenseqa_dev300_rows922-1221.jsonl --rows 0:300 --warm --block 10
  --runs-dir $RUNS --router routers/csqa-divergent-qwen2.5-coder-0.5b.json"
V="--steer results/steering/csqa_letter_stop.mean.npz --steer-layers 10 14 --steer-scale 0.25"
$E borrow --runs-dir $RUNS --run-name csqa_routed_plain --from-run csqa_report_plain --dataset csqa --configs local
$E borrow --runs-dir $RUNS --run-name csqa_routed_s0.25 --from-run csqa_report_s0.25 --dataset csqa --configs local
$E run $ROUTED --run-name csqa_routed_plain --configs learned@0.05 learned@0.05,from=traffic
$E run $ROUTED --run-name csqa_routed_s0.25 $V --configs learned@0.05 learned@0.05,from=traffic
