#!/usr/bin/env bash
# The learned-router runs of docs/studies/learned.md ("A learned router"): the reference pair, upstream as
# llama-server in tokens mode, warmed. The router and the top1 thresholds are fitted on
# CommonsenseQA rows 200-299 (teacher-forced upstream answers); rows 0-199 are reported.
# Resumable: rerun to continue.   nohup nice -n 15 bash eval/studies/learned/learned.sh > eval-learned.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
ROUTER=routers/csqa-qwen2.5-coder-0.5b.json
# The FS-GEN analysis with the router's features, on the reference run's upstream answers.
$EVAL borrow --dataset csqa --run-name router --from-run reference --configs upstream
$EVAL analyze --dataset csqa --run-name router
$EVAL calibrate --dataset csqa --run-name router --fit-rows 200:300 --eval-rows 0:200 --share 0.05 0.1 0.2 \
  --learn $ROUTER
# Live: local, upstream and top1@0.3666 come from the hand-off runs (same code path, eval/studies/handoff/handoff.sh).
$EVAL borrow --dataset csqa --run-name learned --from-run handoff --configs upstream local top1@0.3666
$EVAL run --dataset csqa --rows 0:200 --run-name learned --warm --block 10 --router $ROUTER --configs \
  learned@0.05 learned@0.1 learned@0.2 first@1 first@2 top1@0.1812 top1@0.2235 top1@0.3184
# R2R's divergent labels on the fit rows (mismatches whose two greedy local roll-outs disagree on
# the prediction), a router trained on them, and its live runs.
$EVAL diverge --dataset csqa --run-name router --rows 200:300 --threads 2
DIVERGENT=routers/csqa-divergent-qwen2.5-coder-0.5b.json
$EVAL calibrate --dataset csqa --run-name router --fit-rows 200:300 --eval-rows 0:200 --share 0.03 0.05 0.1 \
  --label divergent --learn $DIVERGENT --out results/runs/router/calibrated_csqa_divergent.yaml
$EVAL borrow --dataset csqa --run-name learned_divergent --from-run learned --configs upstream local top1@0.3184 first@1
$EVAL run --dataset csqa --rows 0:200 --run-name learned_divergent --warm --block 10 --router $DIVERGENT \
  --configs learned@0.03 learned@0.05 learned@0.1
# IFEval (dev rows, first slice; widen --rows to continue): local, upstream and the GSM8K router at
# 10% of tokens (no router is trained on IFEval; GSM8K's is the long-answer one).
$EVAL run --dataset ifeval --rows 0:40 --run-name learned_ifeval --block 4 \
  --router routers/gsm8k-qwen2.5-coder-0.5b.json --configs local upstream learned@0.1
# HumanEval (first slice; widen --rows to continue), the same three configs.
$EVAL run --dataset humaneval --rows 0:24 --run-name learned_humaneval --block 4 \
  --router routers/gsm8k-qwen2.5-coder-0.5b.json --configs local upstream learned@0.1
