#!/usr/bin/env bash
# The learned router at scale (docs/studies/learned.md, "A learned router"), in two lanes, one per core:
#  - GSM8K at 512 answer tokens: local, upstream, the GSM8K router at 5% and top1 at the same share.
#    Both were fitted on rows 50-99 (teacher-forced upstream answers), so those rows are never
#    reported: rows 0-49, then 100-249. Rows 0-29 come from the hand-off runs (same code path).
#  - IFEval with per-task thresholds: the GSM8K router's thresholds refitted on the local model's
#    own answers to IFEval rows 100-149 (`analyze --answers local`, `thresholds`), then the router
#    at 10% on rows 0-39 next to the local and upstream answers of eval/studies/learned/learned.sh, then all three
#    on rows 40-99.
#  - HumanEval, all 164 problems: local, upstream and the GSM8K router at 10% (the first 24 come
#    from eval/studies/learned/learned.sh, same configs and run directory).
# Resumable: rerun to continue; name lanes to run only those (default: gsm8k and ifeval, one per core).
#   nohup nice -n 15 bash eval/studies/learned/learned_scale.sh [gsm8k] [ifeval] [humaneval] > eval-scale.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
GSM8K_ROUTER=routers/gsm8k-qwen2.5-coder-0.5b.json
IFEVAL_ROUTER=routers/ifeval-gsm8k-qwen2.5-coder-0.5b.json

gsm8k_lane() {
  $EVAL borrow --dataset gsm8k --run-name learned_gsm8k --from-run handoff --configs local upstream top1@0.5186 \
    learned@0.05
  # top1 at the router's share (rows 0-31 only: on this machine each GSM8K question takes minutes
  # per config, and the paired test of the router against local-only needs the rows more)
  $EVAL run --dataset gsm8k --rows 0:32 --run-name learned_gsm8k --warm --block 5 --max-tokens 512 \
    --configs top1@0.5186
  for rows in 0:50 100:250; do
    $EVAL run --dataset gsm8k --rows $rows --run-name learned_gsm8k --warm --block 5 --max-tokens 512 \
      --router $GSM8K_ROUTER --configs local upstream learned@0.05
  done
}

ifeval_lane() {
  $EVAL run --dataset ifeval --rows 100:150 --run-name learned_ifeval --block 4 --configs local
  $EVAL analyze --dataset ifeval --run-name learned_ifeval --rows 100:150 --answers local
  $EVAL thresholds --dataset ifeval --run-name learned_ifeval --fit-rows 100:150 --router $GSM8K_ROUTER \
    --share 0.05 0.1 0.2 --out $IFEVAL_ROUTER
  $EVAL borrow --dataset ifeval --run-name learned_ifeval_task --from-run learned_ifeval --configs local upstream
  $EVAL run --dataset ifeval --rows 0:40 --run-name learned_ifeval_task --block 4 --router $IFEVAL_ROUTER \
    --configs learned@0.1
  $EVAL run --dataset ifeval --rows 40:100 --run-name learned_ifeval_task --block 4 --router $IFEVAL_ROUTER \
    --configs local upstream learned@0.1
}

humaneval_lane() {
  $EVAL run --dataset humaneval --rows 0:164 --run-name learned_humaneval --block 4 --router $GSM8K_ROUTER \
    --configs local upstream learned@0.1
}

lanes=("$@")
[ $# -gt 0 ] || lanes=(gsm8k ifeval)
for lane in "${lanes[@]}"; do "${lane}_lane" & done
wait
