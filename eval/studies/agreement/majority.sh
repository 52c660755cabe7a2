#!/usr/bin/env bash
# The majority answer (docs/studies/agreement.md, "The majority answer"): CommonsenseQA rows 922-1,221,
# the reference pair, `answer_check: {kind: agreement, samples: 4, answer: majority}` against the greedy
# answer's records of agreement_csqa_report (4 answers a question: greedy, then 3 sampled at temperature
# 0.7; eval seeds nothing, so these are not that run's samples). Nothing is chosen on these rows: the
# thresholds are the study's three. Resumable: rerun it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
E=".venv/bin/python -m eval"
D=data/commonsenseqa_dev300_rows922-1221.jsonl
$E run --dataset csqa --data $D --rows 0:300 --run-name agreement_csqa_report --block 20 --configs local,agree=4,keep=majority
$E afresh --dataset csqa --run-name agreement_csqa_report --base local,agree=4,keep=majority --check agreement \
  --below 0.3 0.5 0.7
