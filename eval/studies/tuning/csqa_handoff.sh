#!/usr/bin/env bash
# The second pair's token hand-offs on CommonsenseQA (docs/tuning.md): the csqa run's records
# borrowed (local, upstream, agreement; nothing decoded again), entropy thresholds fitted to hand off
# 5% and 10% of the fit rows' local steps, each decoded on the choose and report rows; the rule set
# before decoding: the issue's ceiling, 1.0x. Resumable: rerun it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/tune/csqa-handoff
[ -f $OUT/borrowed.json ] || .venv/bin/python -c 'from pathlib import Path; from fitting.records import borrow
borrow(Path("results/tune/csqa-handoff"), Path("results/tune/csqa"),
       ["prompts__local.jsonl", "prompts__upstream.jsonl", "prompts__local,agree=4.jsonl"])'
.venv/bin/python -m gateway tune --config results/tune/smollm2-qwen1.5b.yaml --alias routed \
  --prompts results/tune/csqa-prompts.jsonl --out $OUT --fit-rows 0:60 --choose-rows 100:160 --report-rows 300:380 \
  --parallel 2 --max-cost-ratio 1.0 --handoff-shares 0.05 0.1
