#!/usr/bin/env bash
# Structured outputs (issue 13): GSM8K answered as {"reasoning": string, "answer": number} under a
# strict JSON schema, on the reference pair (Qwen2.5-Coder 0.5B local, 1.5B upstream). The routed
# config's top1 threshold is the one fitted for 10% of tokens on free-text GSM8K rows 50-99
# (results/runs/reference/calibrated_gsm8k.yaml); reported rows are 0-39. Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/python -m eval run --dataset gsm8k_json --rows 0:40 --run-name structured \
  --configs local upstream top1@0.6348 --block 5
.venv/bin/python -m eval report --dataset gsm8k_json --run-name structured --paired
