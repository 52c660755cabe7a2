#!/usr/bin/env bash
# The agreement check on GSM8K beside the fitted check and the draft (docs/studies/agreement.md,
# "GSM8K"). The reference pair at 512 answer tokens, 4 answers (the greedy one and 3 sampled at 0.7).
# Nothing is fitted. The rule, set before this script decoded anything (the fitted check's own rule
# in docs/studies/afresh.md): on dev rows 0-49, among P in {0.3, 0.5, 0.7}, the most accurate P whose
# cost per correct answer on the frontier-openai sheet is at most 0.8x upstream-only's (ties: the
# cheaper; none: the cheapest); it chose 0.3 (none was at most 0.8x). Reported on dev rows 200-299,
# where the fitted check (chosen on rows 0-49) and the draft were reported and nothing was chosen:
# their local and upstream-only records are borrowed from the run that decoded them (the same
# questions; their greedy answers were decoded on 2 threads, this run's on 1, so a few differ).
# Two lanes, one per core (appends of whole lines; the last record per id wins). Resumable: rerun it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source eval/studies/agreement/common.sh
CHOOSE=agreement_gsm8k_choose
REPORT=agreement_gsm8k_report

( decode gsm8k $CHOOSE 0:50 --max-tokens 512 && decode gsm8k $REPORT 250:275 --max-tokens 512 ) &
first=$!
( decode gsm8k $REPORT 200:250 --max-tokens 512 && decode gsm8k $REPORT 275:300 --max-tokens 512 ) &
second=$!
wait_lanes $first $second

$EVAL borrow --dataset gsm8k --run-name $CHOOSE --from-run learned_gsm8k --configs local upstream
agreement_tables gsm8k $CHOOSE 0:50

$EVAL borrow --dataset gsm8k --run-name $REPORT --from-run price_mixed_gsm8k_draft \
  --configs local upstream "learned@0.05,from=traffic,value=1,escalation=draft"
$EVAL borrow --dataset gsm8k --run-name $REPORT --from-run afresh_gsm8k_untouched --configs "local,afresh=0.18234"
agreement_tables gsm8k $REPORT 200:300
$EVAL report --dataset gsm8k --run-name $REPORT --rows 200:300 --costs-plot docs/results_agreement_gsm8k.png \
  --title "GSM8K dev rows 200-299: the agreement check, the fitted check and the draft"
