#!/usr/bin/env bash
# CommonsenseQA's cost target (issue 51: upstream-only's accuracy within 2 points at at most 0.4x):
# the shipped divergent router's 3% share beside its 5% and 10%, answer_value 1, decisions priced on
# frontier-openai. The rule, set before this script decoded anything: on rows 0-199 (the router's
# report rows; it was fitted on 200-299), the cheapest share on frontier-openai whose accuracy is
# within 2 points of upstream-only's; reported on rows 922-1,221 (5% was read there before: see
# docs/studies/price_aware.md). Resumable: rerun it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source eval/studies/lanes.sh
EVAL=".venv/bin/python -m eval"
CSQA_ROUTER=routers/csqa-divergent-qwen2.5-coder-0.5b.json
$EVAL run --dataset csqa --rows 0:200 --run-name price_decisive_csqa_frontier-openai --warm --block 10 \
  --router $CSQA_ROUTER --decision-sheet frontier-openai --configs learned@0.03,value=1 &
choose=$!
$EVAL run --dataset csqa --data data/commonsenseqa_dev300_rows922-1221.jsonl --rows 0:300 \
  --run-name price_decisive_csqa_report_divergent --warm --block 10 --router $CSQA_ROUTER \
  --decision-sheet frontier-openai --configs learned@0.03,value=1 &
report=$!
wait_lanes $choose $report
