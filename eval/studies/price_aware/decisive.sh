#!/usr/bin/env bash
# Price-aware decisions on short answers (docs/studies/price_aware.md, "Short answers' hand-offs"): in
# an answer expected to run at most 16 tokens a hand-off is weighed against asking directly, not
# against its need. The reference pair, upstream as llama-server, decisions priced on the sheet
# named; answer_value 1 as before. In order of what they decide:
#   1. the shipped divergent router priced on CommonsenseQA rows 922-1,221, untouched by any fit or
#      choice (price-blind beside it: results/steering/runs/csqa_routed_plain);
#   2. the landed price-aware CommonsenseQA figures decoded again (rows 0-199; local, upstream-only
#      and the price-blind routers borrowed as before);
#   3. the token-billed preset as served (mixed router at 5% from traffic, value 1, drafts) on rows
#      922-1,221 (upstream-only borrowed from the agreement check's report run: same rows and pair).
# Not decoded again: the run behind a cached 1,595-token system prompt, whose records show no veto
# and one hand-off per question, which the current code makes too; and long answers (GSM8K,
# HumanEval, IFEval), where no answer is expected to run 16 tokens or fewer.
# Resumable: rerun to continue.   nohup bash eval/studies/price_aware/decisive.sh > decisive.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
MIXED=routers/mixed-qwen2.5-coder-0.5b.json
CSQA_ROUTER=routers/csqa-divergent-qwen2.5-coder-0.5b.json
REPORT_ROWS=data/commonsenseqa_dev300_rows922-1221.jsonl

# the issue's case: the shipped divergent router at its fitted 5% on the untouched rows (price-blind
# beside it: results/steering/runs/csqa_routed_plain, the same rows, pair, router and flags)
$EVAL run --dataset csqa --data $REPORT_ROWS --rows 0:300 --run-name price_decisive_csqa_report_divergent --warm \
  --block 10 --router $CSQA_ROUTER --decision-sheet frontier-openai --configs learned@0.05,value=1

csqa() {  # run, sheet, configs...
  $EVAL borrow --run-name "$1" --from-run learned_divergent --dataset csqa --configs upstream local learned@0.05 learned@0.1
  $EVAL run --dataset csqa --rows 0:200 --run-name "$1" --warm --block 10 --router $CSQA_ROUTER \
    --decision-sheet "$2" --configs "${@:3}"
}
csqa price_decisive_csqa_frontier-openai frontier-openai learned@0.05,value=1
csqa price_decisive_csqa_frontier-openai frontier-openai learned@0.1,value=1

run=price_decisive_csqa_report
$EVAL borrow --run-name $run --from-run agreement_csqa_report --dataset csqa --configs upstream
$EVAL run --dataset csqa --data $REPORT_ROWS --rows 0:300 --run-name $run --warm --block 10 --router $MIXED \
  --decision-sheet frontier-openai --configs local learned@0.05,from=traffic,value=1,escalation=draft

csqa price_decisive_csqa_deepseek deepseek learned@0.05,value=1
