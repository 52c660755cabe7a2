#!/usr/bin/env bash
# Asking afresh on GSM8K (docs/studies/afresh.md, "Asking afresh"): fit on the train split, choose on dev
# rows 0-49, report on dev rows 100-198 (the slice nothing here was chosen on), the reference pair
# at 512 answer tokens. The dev answers are the landed records of eval/studies/learned/learned.sh (local and
# upstream-only, the same code path): a config `local,afresh=P` is derived from them (fitting/afresh.py),
# and decoded for real on a slice of the report rows to check that both agree.
# Resumable: rerun to continue.   nohup nice -n 15 bash eval/studies/afresh/afresh.sh > eval-afresh.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
CHECK=routers/gsm8k-answer-check-qwen2.5-coder-0.5b.json
CHOSEN=${CHOSEN:-0.18234}  # escalate_below picked on the choose rows by the rule in docs/studies/afresh.md

# 1. the local model's own answers to train questions (8-30 s each here, four decoded at once). The
#    shipped check was fitted on the 268 recorded when the session's time ran out (rows 0-139 from
#    one lane, 400-527 from a second lane of --rows 400:800); TRAIN_ROWS=0:0 refits on exactly those.
$EVAL run --dataset gsm8k --data data/gsm8k_train7473.jsonl --rows "${TRAIN_ROWS:-0:800}" \
  --run-name gsm8k_train_local --configs local --max-tokens 512 --parallel 4 --block 8
# 2. the check, fitted on every train answer recorded, with escalate_below for shares of them
$EVAL answer-check --dataset gsm8k --run-name gsm8k_train_local --share 0.3 0.4 0.5 0.6 0.7 --out $CHECK
# 3. choose: every fitted share on dev rows 0-49
$EVAL afresh --dataset gsm8k --run-name afresh_gsm8k_choose --from-run learned_gsm8k --rows 0:50 --check $CHECK \
  --at-shares
$EVAL costs --dataset gsm8k --run-name afresh_gsm8k_choose --sheet frontier-openai --sheet deepseek \
  --sheet frontier-anthropic --sheet self-hosted

# Tasks without a train split (no decoding): fit on some dev rows' local answers, report on others.
# HumanEval gets harder along its rows, so it is split into even and odd rows.
dev_split() {  # dataset, landed run, fit rows, report rows
  local run="afresh_$1" check="results/runs/afresh_$1/check.json"
  mkdir -p "results/runs/$run"
  $EVAL answer-check --dataset "$1" --run-name "$2" --fit-rows "$3" --share 0.1 0.3 0.5 0.7 --out "$check"
  $EVAL afresh --dataset "$1" --run-name "$run" --from-run "$2" --rows "$4" --check "$check" --at-shares
  $EVAL costs --dataset "$1" --run-name "$run" --sheet frontier-openai --sheet deepseek --sheet frontier-anthropic
  $EVAL report --dataset "$1" --run-name "$run" --paired
}
dev_split humaneval learned_humaneval 0:148:2 1:148:2
dev_split ifeval learned_ifeval_task 59:150 0:59
dev_split csqa learned_divergent 100:200 0:100

# 4. report: the chosen value on dev rows 100-198, and decoded for real on rows 100-119
$EVAL run --dataset gsm8k --rows 100:120 --max-tokens 512 --run-name afresh_gsm8k_live --check $CHECK \
  --configs "local,afresh=$CHOSEN" --block 2
$EVAL afresh --dataset gsm8k --run-name afresh_gsm8k_report --from-run learned_gsm8k --rows 100:199 --check $CHECK \
  --below "$CHOSEN" --at-shares --against afresh_gsm8k_live
$EVAL costs --dataset gsm8k --run-name afresh_gsm8k_report --sheet frontier-openai --sheet deepseek \
  --sheet frontier-anthropic --sheet self-hosted
$EVAL report --dataset gsm8k --run-name afresh_gsm8k_report --paired --costs \
  --costs-plot docs/results_afresh_gsm8k.png --title "GSM8K asking afresh, dev rows 100-198 (report slice)"

# 5. one check for mixed traffic: fitted on every fit slice above together, rated on each report slice
M=results/runs/afresh_mixed
mkdir -p $M
$EVAL answer-check --dataset gsm8k --run-name gsm8k_train_local --also humaneval,learned_humaneval,0:148:2 \
  --also ifeval,learned_ifeval_task,59:150 --also csqa,learned_divergent,100:200 --share 0.3 0.5 0.7 --out $M/check.json
for task in "gsm8k learned_gsm8k 100:199" "humaneval learned_humaneval 1:148:2" "ifeval learned_ifeval_task 0:59" \
            "csqa learned_divergent 0:100"; do
  set -- $task
  $EVAL afresh --dataset "$1" --run-name afresh_mixed --from-run "$2" --rows "$3" --check $M/check.json --at-shares
  $EVAL costs --dataset "$1" --run-name afresh_mixed --sheet frontier-openai
done

# 5. a second untouched slice, dev rows 200-299: the same check and value, derived from the local and
#    upstream-only answers decoded beside the draft run (eval/studies/price_aware/price_aware.sh)
mkdir -p results/runs/afresh_gsm8k_untouched
$EVAL afresh --dataset gsm8k --run-name afresh_gsm8k_untouched --from-run price_mixed_gsm8k_draft --rows 200:300 \
  --check $CHECK --below "$CHOSEN" --at-shares
$EVAL costs --dataset gsm8k --run-name afresh_gsm8k_untouched --rows 200:300 --sheet frontier-openai \
  --sheet deepseek --sheet frontier-anthropic --sheet self-hosted
$EVAL report --dataset gsm8k --run-name afresh_gsm8k_untouched --rows 200:300 --paired
