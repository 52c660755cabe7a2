#!/usr/bin/env bash
# Brevity on GSM8K (docs/steering.md, "Measured: brevity on GSM8K"), the reference pair, 512 answer tokens.
# Fit: a mean-difference vector from GSM8K train rows 0-149 (results/steering/gsm8k_brevity.jsonl, question
# text only). Choose: the scale on dev rows 0-49 (test rows 1-50), layers 10-14, local only. The rule, set
# before any row was decoded: of the scales whose accuracy is at least plain's minus 4 points, the one
# with the fewest answer tokens a question (none: the concept fails, and it did). Resumable: rerun it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
G=".venv/bin/python -m gateway"
E=".venv/bin/python -m eval run --dataset gsm8k --max-tokens 512 --runs-dir results/steering/runs"
V="--steer results/steering/gsm8k_brevity.mean.npz --steer-layers 10 14"
[ -f results/steering/gsm8k_brevity.mean.npz ] || $G steer fit --model qwen2.5-coder-0.5b-instruct \
  --pairs results/steering/gsm8k_brevity.jsonl --method mean --out results/steering/gsm8k_brevity.mean.npz
[ -f results/steering/report-gsm8k/report.json ] || $G steer report --model qwen2.5-coder-0.5b-instruct --limit 40 \
  --pairs results/steering/gsm8k_brevity.jsonl results/steering/csqa_brevity.jsonl --out results/steering/report-gsm8k
$E --rows 0:50 --parallel 4 --block 8 --run-name gsm8k_choose_plain --configs local
for s in 0.1 0.2 0.35; do
  $E --rows 0:50 --parallel 4 --block 8 --run-name gsm8k_choose_s$s $V --steer-scale $s --configs local
done
# The rule chose no scale (docs/steering.md): nothing was decoded on the report rows.
