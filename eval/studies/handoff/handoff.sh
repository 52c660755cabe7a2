#!/usr/bin/env bash
# The hand-off economics runs of docs/studies/handoff.md ("What a hand-off costs"): the reference pair with
# the upstream as llama-server in tokens mode (hand-offs extend one cached sequence), routed
# requests warming the upstream with their prompt. Thresholds come from results/runs/reference's
# calibration (fitted on CommonsenseQA rows 200-299 and GSM8K rows 50-99), so the reported rows
# are held out. Resumable: rerun to continue. Two lanes at once, one per core:
#   nohup nice -n 15 bash eval/studies/handoff/handoff.sh > eval-handoff.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
RUN=handoff
# Local-only answers do not depend on the upstream: the reference run's are reused (borrowed, not copied).
$EVAL borrow --dataset csqa --run-name $RUN --from-run reference --configs local

$EVAL run --dataset csqa --rows 0:200 --run-name $RUN --warm --block 10 --configs upstream \
  top1@0.3666 top1@0.3666,span=4,until=word top1@0.3666,span=16,until=sentence &
$EVAL run --dataset gsm8k --rows 0:30 --run-name $RUN --warm --block 5 --max-tokens 512 --configs local upstream \
  top1@0.5186 top1@0.5186,span=4,until=word top1@0.5186,span=16,until=line &
wait
