"""The token-level path: the per-token loop (decoder.py) and what it reads and writes per step."""
