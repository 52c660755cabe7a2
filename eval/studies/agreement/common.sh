# Sourced by the agreement study scripts: the agreement config, its decoding and its tables.
source eval/studies/lanes.sh
EVAL=".venv/bin/python -m eval"
AGREE="local,agree=4"  # the greedy answer and 3 sampled at 0.7
SHEETS=(--sheet frontier-openai --sheet deepseek --sheet frontier-anthropic --sheet self-hosted)

decode() {  # dataset, run name, rows, then any further `eval run` options
  $EVAL run --dataset "$1" --run-name "$2" --rows "$3" --configs $AGREE --block 2 "${@:4}"
}

agreement_tables() {  # dataset, run name, rows: asked afresh below each P, then accuracy, pairs and costs
  $EVAL afresh --dataset "$1" --run-name "$2" --base $AGREE --check agreement --below 0.3 0.5 0.7
  $EVAL report --dataset "$1" --run-name "$2" --rows "$3" --paired
  $EVAL report --dataset "$1" --run-name "$2" --rows "$3" --paired $AGREE  # against its own greedy answers
  $EVAL costs --dataset "$1" --run-name "$2" --rows "$3" "${SHEETS[@]}"
}
