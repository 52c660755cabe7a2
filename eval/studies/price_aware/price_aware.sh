#!/usr/bin/env bash
# The price-aware runs of docs/studies/price_aware.md ("Price-aware routing"): the reference pair, upstream as
# llama-server in tokens mode, warmed; decisions priced with a named sheet (--decision-sheet).
# answer_value is 1 (a correct answer is worth asking the large model for it), chosen before any
# run and not tuned. Routers and thresholds as in eval/studies/learned/learned.sh: CommonsenseQA's divergent-label
# router fitted on rows 200-299, reported on 0-199; GSM8K's fitted on rows 50-99, reported on 0-29
# here. local, upstream and the price-blind learned configs are the landed records of the same
# rows and code path (borrowed, not re-run). Resumable: rerun to continue.
#   nohup nice -n 15 bash eval/studies/price_aware/price_aware.sh > eval-price.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../../.."

EVAL=".venv/bin/python -m eval"
CSQA_ROUTER=routers/csqa-divergent-qwen2.5-coder-0.5b.json
GSM8K_ROUTER=routers/gsm8k-qwen2.5-coder-0.5b.json

borrowed() {  # into-run, from-run, dataset, configs...: records the run's change does not touch
  $EVAL borrow --run-name "$1" --from-run "$2" --dataset "$3" --configs "${@:4}"
}

csqa() {  # sheet, configs...
  local run="price_csqa_$1"
  borrowed "$run" learned_divergent csqa upstream local learned@0.05 learned@0.1
  $EVAL run --dataset csqa --rows 0:200 --run-name "$run" --warm --block 10 --router $CSQA_ROUTER \
    --decision-sheet "$1" --configs "${@:2}"
}
csqa frontier-openai learned@0.05,value=1 learned@0.1,value=1
csqa deepseek learned@0.05,value=1

run=price_gsm8k_frontier-openai
borrowed "$run" learned_gsm8k gsm8k upstream local learned@0.05
$EVAL run --dataset gsm8k --rows 0:30 --max-tokens 512 --run-name "$run" --warm --block 2 --router $GSM8K_ROUTER \
  --decision-sheet frontier-openai --configs learned@0.05,value=1

# max_cost_ratio 1: the per-answer distribution of billed over asking directly (frontier-openai's
# prices, the prompt under its cache minimum so every hand-off re-bills it)
$EVAL run --dataset gsm8k --rows 0:30 --max-tokens 512 --run-name "$run" --warm --block 2 --router $GSM8K_ROUTER \
  --decision-sheet frontier-openai --configs learned@0.05,ceiling=1
run=price_ifeval_frontier-openai  # local, upstream and learned@0.1 copied from learned_ifeval_task's rows 0-29
$EVAL run --dataset ifeval --rows 0:30 --run-name "$run" --block 2 --router routers/ifeval-gsm8k-qwen2.5-coder-0.5b.json \
  --decision-sheet frontier-openai --configs learned@0.1,ceiling=1

# The same questions behind one shared 1,595-token system prompt (data/system_prompt_assistant.md)
# that the provider's cache holds: every answer's first upstream call reads it as cached tokens.
run=price_csqa_system1500_frontier-openai
$EVAL run --dataset csqa --rows 0:200 --run-name "$run" --warm --block 5 --router $CSQA_ROUTER \
  --decision-sheet frontier-openai --system data/system_prompt_assistant.md \
  --configs local upstream learned@0.05 learned@0.05,value=1

# HumanEval, all 164, the mixed router at 5% from traffic priced on frontier-openai (these ~170-token
# prompts are under its cache minimum, so every hand-off re-bills the prompt), beside the same router
# price-blind in the run eval/studies/mixed/mixed.sh makes (local and upstream-only there too)
$EVAL run --dataset humaneval --rows 0:164 --run-name mixed_traffic_humaneval_tail8 --block 4 --threads 2 \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai \
  --configs learned@0.05,from=traffic,value=1

# The same after priced decisions expect an answer as long as recent answers run (before: as long
# as max_tokens allows, 384 here against a median answer of 178): local, upstream-only and the
# price-blind router borrowed from the run above, which they do not depend on
run=price_humaneval_expected_length
borrowed "$run" mixed_traffic_humaneval_tail8 humaneval local upstream learned@0.05,from=traffic
$EVAL run --dataset humaneval --rows 0:164 --run-name "$run" --block 4 --threads 2 \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai \
  --configs learned@0.05,from=traffic,value=1
$EVAL report --dataset humaneval --run-name "$run" --paired

# GSM8K rows 0-29 the same way (the GSM8K router, 512 tokens allowed): local, upstream-only and the
# price-blind router borrowed from price_gsm8k_frontier-openai
run=price_gsm8k_expected_length
borrowed "$run" price_gsm8k_frontier-openai gsm8k upstream local learned@0.05
$EVAL run --dataset gsm8k --rows 0:30 --max-tokens 512 --run-name "$run" --warm --block 2 --router $GSM8K_ROUTER \
  --decision-sheet frontier-openai --configs learned@0.05,value=1
$EVAL report --dataset gsm8k --rows 0:30 --run-name "$run" --paired

# Escalations asked afresh (routing.escalation: afresh; the answers are held, as a request that
# does not stream): the same config as above on GSM8K rows 0-29, where the landed records showed
# the upstream continuing the local opening right on 7 of 26 escalated answers and asked afresh on
# 13; the records the change does not touch borrowed
run=price_gsm8k_escalate_afresh
borrowed "$run" price_gsm8k_expected_length gsm8k upstream local learned@0.05 learned@0.05,value=1
$EVAL run --dataset gsm8k --rows 0:30 --max-tokens 512 --run-name "$run" --warm --block 2 --router $GSM8K_ROUTER \
  --decision-sheet frontier-openai --configs learned@0.05,value=1,escalation=afresh
$EVAL report --dataset gsm8k --rows 0:30 --run-name "$run" --paired

# ... and on the mixed router's report rows 100-199 (nothing was fitted or chosen on them; the
# escalation mode was chosen from the records above), beside the price-blind router decoded there
run=price_mixed_gsm8k_escalate_afresh
borrowed "$run" mixed_traffic_gsm8k_tail8 gsm8k upstream local learned@0.05,from=traffic
$EVAL run --dataset gsm8k --rows 100:200 --max-tokens 512 --run-name "$run" --warm --block 2 --threads 2 \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai \
  --configs learned@0.05,from=traffic,value=1,escalation=afresh
$EVAL report --dataset gsm8k --rows 100:200 --run-name "$run" --paired

# IFEval's 50 untouched rows (150-199), where the price-blind mixed router gained nothing (24.0%,
# as local; upstream-only 38.0%) at 10 calls a question: the same router price-aware, escalations
# asked afresh
run=price_mixed_ifeval_escalate_afresh
borrowed "$run" mixed_traffic_ifeval ifeval upstream local learned@0.05,from=traffic
$EVAL run --dataset ifeval --rows 150:200 --run-name "$run" --block 4 --threads 2 \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai \
  --configs learned@0.05,from=traffic,value=1,escalation=afresh
$EVAL report --dataset ifeval --rows 150:200 --run-name "$run" --paired

# HumanEval, all 164, the same way: the records said continuing was as accurate there and cheaper
run=price_humaneval_escalate_afresh
borrowed "$run" price_humaneval_expected_length humaneval upstream local learned@0.05,from=traffic \
  learned@0.05,from=traffic,value=1
$EVAL run --dataset humaneval --rows 0:164 --run-name "$run" --block 4 --threads 2 \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai \
  --configs learned@0.05,from=traffic,value=1,escalation=afresh
$EVAL report --dataset humaneval --run-name "$run" --paired

# Drafts (routing.escalation: draft): the same router and price rule, and no hand-off made before an
# escalation, since a fresh answer throws away what they bought. Chosen from the records of rows
# 100-199 above (81 of 100 answers asked afresh after about 3 hand-offs each); reported on GSM8K dev
# rows 200-299, which nothing had decoded before, with local and upstream-only decoded beside it
run=price_mixed_gsm8k_draft  # decoded with flash attention on, the default then
$EVAL run --dataset gsm8k --rows 200:300 --max-tokens 512 --run-name "$run" --warm --block 2 --threads 2 --flash-attn \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai \
  --configs local upstream learned@0.05,from=traffic,value=1,escalation=draft
$EVAL report --dataset gsm8k --rows 200:300 --run-name "$run" --paired

# Drafts on the two other tasks, where the records above only derived them: IFEval's untouched rows
# 150-199 and HumanEval's 164 problems, the same config as on GSM8K rows 200-299, local and
# upstream-only borrowed from the escalations-afresh runs of the same rows (flash attention off, as
# served)
run=price_mixed_ifeval_draft
borrowed "$run" price_mixed_ifeval_escalate_afresh ifeval upstream local learned@0.05,from=traffic \
  learned@0.05,from=traffic,value=1,escalation=afresh
$EVAL run --dataset ifeval --rows 150:200 --run-name "$run" --block 4 --threads 2 \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai \
  --configs learned@0.05,from=traffic,value=1,escalation=draft
$EVAL report --dataset ifeval --rows 150:200 --run-name "$run" --paired

run=price_humaneval_draft
borrowed "$run" price_humaneval_escalate_afresh humaneval upstream local learned@0.05,from=traffic \
  learned@0.05,from=traffic,value=1 learned@0.05,from=traffic,value=1,escalation=afresh
$EVAL run --dataset humaneval --rows 0:164 --run-name "$run" --block 4 --threads 2 \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai \
  --configs learned@0.05,from=traffic,value=1,escalation=draft
$EVAL report --dataset humaneval --run-name "$run" --paired

# The price-blind mixed router on the same untouched GSM8K rows 200-299, beside the draft run (flash
# attention on, as that run was decoded): does the token-level router's gain hold on rows nothing
# was chosen on, and what does the draft add to it
$EVAL run --dataset gsm8k --rows 200:300 --max-tokens 512 --run-name price_mixed_gsm8k_draft --warm --block 2 --threads 2 --flash-attn \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai --configs learned@0.05,from=traffic
$EVAL report --dataset gsm8k --rows 200:300 --run-name price_mixed_gsm8k_draft --paired

# What the 0.5x target allows: each task's bound for answer-level choices (the local answer where it
# is right, else the upstream's), priced beside the configs above, bare and behind a cached prompt
bound() {  # dataset, run, rows
  for prefix in 0 1500; do
    $EVAL costs --dataset "$1" --run-name "$2" --rows "$3" --answer-oracle --shared-prefix $prefix \
      --sheet frontier-openai --sheet deepseek --sheet frontier-anthropic
  done
}
bound gsm8k price_mixed_gsm8k_draft 200:300
bound humaneval price_humaneval_draft 0:164
bound ifeval price_mixed_ifeval_draft 150:200
bound csqa price_csqa_frontier-openai 0:200
$EVAL costs --dataset csqa --run-name price_csqa_system1500_frontier-openai --answer-oracle \
  --sheet frontier-openai --sheet deepseek --sheet frontier-anthropic

# The upstream writing the opening (one hand-off of the first 32 tokens, then local), fixed before
# the run, on the same untouched GSM8K rows (flash attention off, as served)
$EVAL run --dataset gsm8k --rows 200:300 --max-tokens 512 --run-name price_mixed_gsm8k_draft --warm --block 2 --threads 2 \
  --configs first@1,span=32
$EVAL costs --dataset gsm8k --rows 200:300 --run-name price_mixed_gsm8k_draft --answer-oracle \
  --sheet frontier-openai --sheet deepseek --sheet frontier-anthropic --plot docs/results_price_gsm8k.png \
  --title "GSM8K, untouched dev rows 200-299: price-aware configs and what a perfect choice would cost"

# IFEval rows 59-99 as well: rows the mixed router never saw (it fitted on rows 0-58 and its
# thresholds on 100-149; the draft and afresh choices were made before any of these runs), so with
# rows 150-199 91 rows nothing of these configs was fitted or chosen on
$EVAL run --dataset ifeval --rows 59:100 --run-name price_mixed_ifeval_draft --block 4 --threads 2 \
  --router routers/mixed-qwen2.5-coder-0.5b.json --decision-sheet frontier-openai --configs local upstream \
  learned@0.05,from=traffic learned@0.05,from=traffic,value=1,escalation=afresh \
  learned@0.05,from=traffic,value=1,escalation=draft
$EVAL report --dataset ifeval --run-name price_mixed_ifeval_draft --paired
for prefix in 0 1500; do
  $EVAL costs --dataset ifeval --run-name price_mixed_ifeval_draft --shared-prefix $prefix --answer-oracle \
    --sheet frontier-openai --sheet deepseek --sheet frontier-anthropic --sheet self-hosted
done
