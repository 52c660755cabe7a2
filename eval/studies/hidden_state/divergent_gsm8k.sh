#!/usr/bin/env bash
# Divergent labels on GSM8K's train split (docs/studies/hidden_state.md, "Divergent labels on GSM8K's train
# split"): does a token router fitted on the mismatches that change the answer rank them better
# than the same router fitted on every mismatch? Train rows only; each half of the labelled answers
# (even rows, odd rows) is rated by a router fitted on the other half.
# Resumable: rerun to continue.   nohup nice -n 15 bash eval/studies/hidden_state/divergent_gsm8k.sh > eval-divergent.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
TRAIN="--dataset gsm8k --data data/gsm8k_train7473.jsonl"
ROWS=${ROWS:-0:46}  # the labelled rows when the session's time ran out (35 answers: 0-12 and 24-45)

# 1. labels: teacher-force the upstream's train answers (256 tokens), then two local roll-outs per
#    mismatch (45-60 s an answer here with eight roll-outs decoded at once; three answers labelled
#    together with twelve at once took about 110 s an answer)
$EVAL analyze $TRAIN --rows 0:109 --run-name gsm8k_train_hidden --threads 2
$EVAL diverge $TRAIN --rows "$ROWS" --run-name gsm8k_train_hidden --threads 2 --parallel 8
# 2. fitted on one half, rated on the other (AUROC on divergent labels, beside the same features
#    fitted on every mismatch, the fixed signals, and the router's reliability table)
start=${ROWS%%:*} stop=${ROWS##*:}
for half in 0 1; do
  $EVAL calibrate --dataset gsm8k --run-name gsm8k_train_hidden --share 0.05 0.1 --label divergent \
    --fit-rows "$((start + half)):$stop:2" --eval-rows "$((start + 1 - half)):$stop:2" \
    --learn "results/runs/gsm8k_train_hidden/router_divergent_half$half.json" \
    --out "results/runs/gsm8k_train_hidden/calibrated_half$half.yaml"
done
# 3. R2R's combination: divergent labels with the hidden state (eval.studies.hidden_state.hidden_router's MLP beside the
#    logistic router and an MLP on the scalars), each half rated by routers fitted on the other half
.venv/bin/python -m eval.studies.hidden_state.hidden_router --label divergent --dataset gsm8k --train-run gsm8k_train_hidden \
  --train-data data/gsm8k_train7473.jsonl --train-rows "$ROWS" --threads 2
