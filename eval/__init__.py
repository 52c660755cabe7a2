"""Evaluation harness: run public benchmarks through the real collaborative decoder.

`python -m eval run` decodes a dataset with the local model in-process and the upstream as a
real llama-cpp-python server over HTTP, for several routing configurations, writing one JSONL
line per item; `analyze` is the FS-GEN teacher-forcing analysis; `calibrate` turns an analysis
into thresholds; `report` writes the markdown table and the plot. See docs/results.md.
"""
