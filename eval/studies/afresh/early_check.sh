#!/usr/bin/env bash
# Asking afresh after the first 128 tokens on GSM8K (docs/studies/afresh.md, "Asking afresh", "Rating
# earlier"): the same protocol as eval/studies/afresh/afresh.sh with a check read at K = 128 tokens (the fewest of
# 16/32/64/128/192 within 0.02 of the whole-answer check's two-fold AUROC on the train answers,
# `python -m eval.studies.afresh.early_rating`). Fitted on train rows 0-139, escalate_below chosen on dev rows 0-49
# by eval/studies/afresh/afresh.sh's rule, reported on dev rows 100-198; records derived from the landed local and
# upstream-only records (fitting/afresh.py), the local answers' signals from their analysis.
# Resumable: rerun to continue.   nohup nice -n 15 bash eval/studies/afresh/early_check.sh > eval-early.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
CHECK=routers/gsm8k-answer-check-at128-qwen2.5-coder-0.5b.json
SHEETS="--sheet frontier-openai --sheet deepseek --sheet frontier-anthropic --sheet self-hosted"

# 1. the local model's signals along its own answers: train rows (fit) and dev rows (choose, report)
$EVAL analyze --dataset gsm8k --data data/gsm8k_train7473.jsonl --rows 0:140 --run-name gsm8k_train_local \
  --answers local --threads 2
$EVAL analyze --dataset gsm8k --rows 0:50 --run-name learned_gsm8k --answers local --threads 2
$EVAL analyze --dataset gsm8k --rows 100:199 --run-name learned_gsm8k --answers local --threads 2
# 2. the check, read at 128 tokens, fitted on train answers
$EVAL answer-check --dataset gsm8k --run-name gsm8k_train_local --fit-rows 0:140 --at-tokens 128 \
  --share 0.3 0.4 0.5 0.6 0.7 --out $CHECK
# 3. choose on dev rows 0-49
$EVAL afresh --dataset gsm8k --run-name early_gsm8k_choose --from-run learned_gsm8k --rows 0:50 --check $CHECK \
  --at-shares
$EVAL costs --dataset gsm8k --run-name early_gsm8k_choose $SHEETS
# 4. report on dev rows 100-198 (CHOSEN: the value step 3 picked)
if [ -n "${CHOSEN:-}" ]; then
  $EVAL afresh --dataset gsm8k --run-name early_gsm8k_report --from-run learned_gsm8k --rows 100:199 \
    --check $CHECK --below "$CHOSEN" --at-shares
  $EVAL costs --dataset gsm8k --run-name early_gsm8k_report $SHEETS
  $EVAL report --dataset gsm8k --run-name early_gsm8k_report --paired --costs
fi
# 5. decoded for real on rows 100-119 (local, upstream-only and the chosen config in one run, so that
#    the derived records come from answers decoded on the same machine), derived again from them
if [ -n "${CHOSEN:-}" ]; then
  $EVAL run --dataset gsm8k --rows 100:120 --max-tokens 512 --run-name early_gsm8k_live --check $CHECK \
    --configs local upstream "local,afresh=$CHOSEN" --block 2
  $EVAL analyze --dataset gsm8k --rows 100:120 --run-name early_gsm8k_live --answers local --threads 2
  $EVAL afresh --dataset gsm8k --run-name early_gsm8k_compare --from-run early_gsm8k_live --check $CHECK \
    --below "$CHOSEN" --against early_gsm8k_live
fi
# 6. a second untouched slice, dev rows 200-299: the local answers decoded beside the draft run
#    (eval/studies/price_aware/price_aware.sh), their signals, and the chosen value derived on them
if [ -n "${CHOSEN:-}" ]; then
  $EVAL analyze --dataset gsm8k --rows 200:300 --run-name price_mixed_gsm8k_draft --answers local --threads 2
  mkdir -p results/runs/early_gsm8k_untouched
  $EVAL afresh --dataset gsm8k --run-name early_gsm8k_untouched --from-run price_mixed_gsm8k_draft --rows 200:300 \
    --check $CHECK --below "$CHOSEN" --at-shares
  $EVAL costs --dataset gsm8k --run-name early_gsm8k_untouched --rows 200:300 $SHEETS
  $EVAL report --dataset gsm8k --run-name early_gsm8k_untouched --rows 200:300 --paired
fi
