"""Named routings: `routing: {preset: token-billed}` is the configuration that measured best for its
kind of upstream, in one word. Fields given beside a preset override its values.

- `token-billed` (an upstream that bills by the token: OpenAI, Anthropic, DeepSeek): the learned
  mixed router routes the 5% of steps it scores highest on the tenant's own traffic, each hand-off
  is made only if worth its predicted price (`answer_value: 1`), and an answer that does not stream
  is a local draft until the hand-offs it would need cost more than one call, when the upstream is
  asked afresh (`escalation: draft`). Measured as served, on questions nothing was fitted or chosen
  on (docs/routing.md, Presets): GSM8K 53.0% (local 33.0%, upstream-only 55.0%) at 0.88x
  upstream-only's cost per correct answer, HumanEval 65.2% (53.7%, 68.3%) at 0.54x; on
  CommonsenseQA's one-letter answers it gains nothing (25.0% against 22.3%, upstream-only 56.3%):
  5% of steps reaches the letter of one question in eight.
- `self-hosted` (an upstream you run, billed by nothing but its compute): the same router and
  share, hand-offs unpriced.

- `learning` (any local model, any upstream): routing that learns on its own traffic
  (docs/routing.md, "Routing that learns"): every answer that does not stream is asked of the
  upstream afresh until an answer check fitted on the alias's shadow samples is promoted, which
  then holds 90% agreement with upstream-only answers at the lowest cost its examples allow.

The first two need the router fitted for their local model, Qwen2.5-Coder-0.5B-Instruct. An alias whose local
model is another gets the preset's fallback instead (and a start-up line and `check-config` say so):
`token-billed` the agreement check, which needs no fitted file (the greedy answer and three samples;
an answer fewer than 3 of 4 agree on is asked afresh), `self-hosted` an entropy threshold of 2 nats.
"""

from __future__ import annotations

from typing import Any, Literal

Preset = Literal["token-billed", "self-hosted", "learning"]
ROUTER = "routers/mixed-qwen2.5-coder-0.5b.json"
_LEARNED = {"policy": "learned", "target_fraction": 0.05, "threshold_from": "traffic", "router": ROUTER}
PRESETS: dict[str, dict[str, Any]] = {
    "token-billed": {**_LEARNED, "answer_value": 1.0, "escalation": "draft"},
    "self-hosted": dict(_LEARNED),
    "learning": {"policy": "never", "shadow": {"rate": 0.2}, "quality_target": 0.9, "learn": {"enabled": True}},
}
FALLBACKS: dict[str, dict[str, Any]] = {  # where the preset's router was fitted for another local model
    "token-billed": {"policy": "never", "answer_check": {"kind": "agreement", "samples": 4}, "escalate_below": 0.75},
    "self-hosted": {"policy": "entropy", "threshold": 2.0},
}


def expanded(routing: dict[str, Any], fallback: bool = False) -> dict[str, Any]:
    """`routing` (alias routing fields as configured) with its preset's values under the fields it
    gives itself; `fallback`: the preset's fallback's values instead."""
    preset = routing.get("preset")
    if preset not in PRESETS:
        return routing
    values = (FALLBACKS if fallback else PRESETS)[preset]
    return {**values, **{key: value for key, value in routing.items() if value is not None}}
