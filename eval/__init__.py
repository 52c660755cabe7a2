"""Evaluation harness: run public benchmarks through the real collaborative decoder.

`python -m eval run` decodes a dataset with the local model in-process and the upstream as a
real server process over HTTP, for several routing configurations, writing one JSONL line per
item; `analyze` is the FS-GEN teacher-forcing analysis; `calibrate` turns an analysis into
thresholds; `report` writes the markdown table and the plot; `costs` re-prices records on price
sheets. How to use it: docs/evaluation.md. The studies built on it (their recipes and one-off
command lines) are in eval/studies/; what they measured is docs/results.md.

What the harness shares with `python -m gateway tune` and `steer` (the runner, datasets, scoring,
records, calibration, ...) is in fitting/, which the gateway packages; eval/ keeps the command
line and what only the studies use, and nothing packaged imports it.
"""
