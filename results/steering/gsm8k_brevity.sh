#!/usr/bin/env bash
# Brevity on GSM8K (docs/steering.md, "Measured: brevity on GSM8K"), the reference pair, 512 answer tokens.
# Fit: a mean-difference vector from GSM8K train rows 0-149 (results/steering/gsm8k_brevity.jsonl, question
# text only). Choose: the scale on dev rows 0-49 (test rows 1-50), layers 10-14, local only. The rule, set
# before any row was decoded: of the scales whose accuracy is at least plain's minus 4 points, the one
# with the fewest answer tokens a question (none: the concept fails). Report: test rows 1,001-1,160
# (the first 160 of the untouched slice) local only, plain and the chosen scale; and routed on its first
# 40 rows (the GSM8K learned router, fitted 5% threshold, price-blind), plain and steered.
# Resumable: rerun it. SCALE names the chosen scale once the choice is read.
set -euo pipefail
cd "$(dirname "$0")/../.."
G=".venv/bin/python -m gateway"
E=".venv/bin/python -m eval run --dataset gsm8k --max-tokens 512 --runs-dir results/steering/runs"
V="--steer results/steering/gsm8k_brevity.mean.npz --steer-layers 10 14"
REPORT="--data data/gsm8k_test319_rows1001-1319.jsonl"
[ -f results/steering/gsm8k_brevity.mean.npz ] || $G steer fit --model qwen2.5-coder-0.5b-instruct \
  --pairs results/steering/gsm8k_brevity.jsonl --method mean --out results/steering/gsm8k_brevity.mean.npz
[ -f results/steering/report-gsm8k/report.json ] || $G steer report --model qwen2.5-coder-0.5b-instruct --limit 40 \
  --pairs results/steering/gsm8k_brevity.jsonl results/steering/csqa_brevity.jsonl --out results/steering/report-gsm8k
$E --rows 0:50 --parallel 4 --block 8 --run-name gsm8k_choose_plain --configs local
for s in 0.1 0.2 0.35; do
  $E --rows 0:50 --parallel 4 --block 8 --run-name gsm8k_choose_s$s $V --steer-scale $s --configs local
done
[ -n "${SCALE:-}" ] || { echo "choose: read the choose runs, then SCALE=<scale> bash $0"; exit 0; }
$E $REPORT --rows 0:160 --parallel 4 --block 8 --run-name gsm8k_report_plain --configs local
$E $REPORT --rows 0:160 --parallel 4 --block 8 --run-name gsm8k_report_s$SCALE $V --steer-scale $SCALE --configs local
ROUTED="$REPORT --rows 0:40 --warm --block 2 --router routers/gsm8k-qwen2.5-coder-0.5b.json --configs learned@0.05"
$E $ROUTED --run-name gsm8k_report_plain
$E $ROUTED --run-name gsm8k_report_s$SCALE $V --steer-scale $SCALE
