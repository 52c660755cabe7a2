"""Fitting: the tools that fit the gateway to a user's own prompts and models, shipped with it.

`python -m gateway tune` (tune.py: an alias's answer-level routing, decoded through the gateway's
real decoder by runner.py) and `python -m gateway steer fit|report` (steering/: control vectors
and per-layer read-outs, the hidden states read through adapters.hidden_states), registered on the
gateway's parser by cli.py, and what the study harness (eval/, `python -m eval`) shares with them:
datasets, scoring, records, price sheets, calibration, learned routers.

Layers (pyproject.toml, [tool.importlinter]): only gateway.__main__ imports this package; it
imports the gateway's lower layers, adapters and policies, never eval/ or bench/. What it needs
beyond the gateway's own dependencies is the `fitting` extra (extras.py).
"""
