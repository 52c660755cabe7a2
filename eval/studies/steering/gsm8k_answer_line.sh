#!/usr/bin/env bash
# The answer line on GSM8K (docs/steering.md, "Measured: the answer line on GSM8K"), the reference pair,
# 512 answer tokens, eval's GSM8K prompt (which asks for a last line 'Answer: <number>'; the plain
# model writes \boxed{} instead). Fit: a mean-difference vector from GSM8K train rows 150-299
# (results/steering/gsm8k_answer_line.jsonl, question text only). Choose: the scale on dev rows 0-49
# (test rows 1-50; plain is the brevity lane's gsm8k_choose_plain), layers 10-14, local only. The rule,
# set before any steered row was decoded: of the scales whose accuracy is at least plain's minus 4
# points, the one whose answers most often end with the 'Answer:' line (none: the concept fails).
# Report: test rows 1,001-1,160 local only, plain and the chosen scale. Resumable: rerun it. SCALE
# names the chosen scale once the choice is read.
set -euo pipefail
cd "$(dirname "$0")/../../.."
G=".venv/bin/python -m gateway"
E=".venv/bin/python -m eval run --dataset gsm8k --max-tokens 512 --runs-dir results/steering/runs --parallel 4 --block 8"
VEC=results/steering/gsm8k_answer_line.mean.npz
V="--steer $VEC --steer-layers 10 14"
[ -f $VEC ] || $G steer fit --model qwen2.5-coder-0.5b-instruct \
  --pairs results/steering/gsm8k_answer_line.jsonl --method mean --out $VEC
[ -f results/steering/report-gsm8k-answer-line/report.json ] || $G steer report --model qwen2.5-coder-0.5b-instruct \
  --limit 40 --pairs results/steering/gsm8k_answer_line.jsonl results/steering/gsm8k_brevity.jsonl \
  --out results/steering/report-gsm8k-answer-line
$E --rows 0:50 --run-name gsm8k_choose_plain --configs local
# 0.15 was added after 0.1 and 0.25 were read on these rows (compliance 18% and 98%), by the same rule
for s in 0.1 0.25 0.15; do
  $E --rows 0:50 --run-name gsm8k_choose_line_s$s $V --steer-scale $s --configs local
done
[ -n "${SCALE:-}" ] || { echo "choose: read the choose runs, then SCALE=<scale> bash $0"; exit 0; }
REPORT="--data data/gsm8k_test319_rows1001-1319.jsonl --rows 0:160"
$E $REPORT --run-name gsm8k_report_plain --configs local
$E $REPORT --run-name gsm8k_report_line_s$SCALE $V --steer-scale $SCALE --configs local
