#!/usr/bin/env bash
# Reproduces docs/studies/reference.md on the reference pair (Qwen2.5-Coder 0.5B local, 1.5B upstream).
# Every step is resumable: rerun this script to continue where it stopped.
#   nohup nice -n 15 bash eval/studies/reference/reference.sh > eval-reference.log 2>&1 &
# Optional first argument: "csqa" or "gsm8k" to run only that dataset's steps.
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
RUN=reference
RUNS=results/runs/$RUN
ONLY=${1:-all}

if [[ $ONLY == all || $ONLY == csqa ]]; then
  # Upstream answers on all 300 dev rows: rows 200-299 are only for calibration.
  $EVAL run --dataset csqa --rows 0:300 --run-name $RUN --configs upstream
  $EVAL run --dataset csqa --rows 0:200 --run-name $RUN --configs local
  $EVAL analyze --dataset csqa --run-name $RUN
  $EVAL analyze --dataset csqa --run-name $RUN --rows 0:200
  # Thresholds fitted on rows 200-299 (label-free: upstream share targets), reported on 0-199.
  $EVAL calibrate --dataset csqa --run-name $RUN --fit-rows 200:300 --eval-rows 0:200 --share 0.1 0.25 0.5
  # The calibrate protocol on exact halves (teacher-forced numbers only; no decoding).
  $EVAL calibrate --dataset csqa --run-name $RUN --fit-rows 0:150 --eval-rows 150:300 \
    --share 0.1 0.25 0.5 --accuracy 0.8 0.9 --out $RUNS/calibration_halves_csqa.yaml
  $EVAL run --dataset csqa --rows 0:200 --run-name $RUN --configs oracle \
    --configs-from $RUNS/calibrated_csqa.yaml --block 10
fi

if [[ $ONLY == all || $ONLY == gsm8k ]]; then
  $EVAL run --dataset gsm8k --rows 0:100 --run-name $RUN --configs local upstream --block 10
  $EVAL analyze --dataset gsm8k --run-name $RUN
  # Calibrated on one half of rows 0-99, every config reported on the other half. The shares sit
  # around the FS-GEN mismatch share (7.1%); each hand-off re-sends the prompt and answer so far.
  $EVAL calibrate --dataset gsm8k --run-name $RUN --fit-rows 50:100 --eval-rows 0:50 --share 0.05 0.1 0.2
  SNIPPET=$RUNS/calibrated_gsm8k.yaml
  # Two lanes, one per core (a run holds one thread per model). Each config has its own records
  # file, so the lanes never write the same one.
  (
    $EVAL run --dataset gsm8k --rows 0:50 --run-name $RUN --configs oracle --configs-from $SNIPPET \
      --configs-keys entropy-share-0.05 entropy-share-0.1 entropy-share-0.2 margin-share-0.2 --block 5
  ) &
  (
    $EVAL run --dataset gsm8k --rows 0:50 --run-name $RUN --configs-from $SNIPPET \
      --configs-keys top1-share-0.05 top1-share-0.1 top1-share-0.2 margin-share-0.05 margin-share-0.1 --block 5
    # One routed point on all 100 rows.
    $EVAL run --dataset gsm8k --rows 50:100 --run-name $RUN --configs-from $SNIPPET \
      --configs-keys top1-share-0.05 --block 5
  ) &
  wait
  # target_fraction: the two lanes split the rows (appends of whole lines; the last record per id wins).
  for rows in 0:25 25:50; do
    $EVAL run --dataset gsm8k --rows $rows --run-name $RUN --configs-from $SNIPPET --block 5 \
      --configs-keys target_fraction-share-0.05 target_fraction-share-0.1 target_fraction-share-0.2 &
  done
  wait
fi

# Tables and plots (docs/studies/reference.md quotes them).
$EVAL report --dataset csqa --run-name $RUN --rows 0:200 --plot docs/results_csqa.png
$EVAL report --dataset gsm8k --run-name $RUN --rows 0:50 --paired --plot docs/results_gsm8k.png
$EVAL report --dataset gsm8k --run-name $RUN --rows 0:100 --configs local upstream top1@0.5186
