#!/usr/bin/env bash
# Routing-history features (docs/studies/history.md): the logistic router fitted with and without
# the previous step's signals and the routing so far, on each task's teacher-forced upstream answers,
# rated on held-out ones. No decoding: it reads the analysis records the other studies made
# (router, gsm8k_train_hidden, learned_ifeval_task, mixed_mbpp) and writes results/runs/history/<dataset>.json.
#   bash eval/studies/history/history.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."

HISTORY=".venv/bin/python -m eval.studies.history.history_features"
$HISTORY --fit gsm8k,gsm8k_train_hidden --held-out gsm8k,router,0:100
$HISTORY --fit csqa,router,200:300 --held-out csqa,router,0:100
$HISTORY --fit ifeval,learned_ifeval_task,0:59:2 --held-out ifeval,learned_ifeval_task,1:59:2
$HISTORY --fit mbpp,mixed_mbpp,307:367 --held-out mbpp,mixed_mbpp,264:307
