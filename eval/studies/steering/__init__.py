"""Steering the local model: contrast pairs, recipes and summaries of docs/steering.md's measurements."""
