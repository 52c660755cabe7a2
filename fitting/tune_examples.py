"""`python -m gateway tune --from-examples`: fit an alias's answer check on the labelled examples a
learning gateway (`routing.learn`) already holds in its Redis store, with no prompts file and
nothing decoded: the same fit, held-out split and bar as the gateway's own (policies/online_check.py).

Writes to `out`: the check file (answer-check.json, stamped with the local model's sha256: an
alias may name it as `routing.answer_check`), alias.yaml (that routing with the bar chosen for the
target) and tune-report.md (the examples, the held-out ranking, the bar and what it predicts).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import yaml

from adapters.model_files import model_sha256
from adapters.redis_store import RedisStore
from fitting.records import write_json
from gateway.settings import StoreSettings, load_settings
from gateway.shadow.learning import learning_key
from policies.online_check import Candidate, Example, fit_candidate

CHECK_FILE, REPORT_FILE, SNIPPET_FILE = "answer-check.json", "tune-report.md", "alias.yaml"


def tune_from_examples(config: Path, alias: str, out: Path, target: float | None = None,
                       held_out: float = 0.3) -> Candidate:
    """Fit and write (see the module docstring); ValueError naming what is missing."""
    settings = load_settings(config)
    if alias not in settings.aliases:
        raise ValueError(f"no alias '{alias}' in {config}")
    routing = settings.aliases[alias].routing
    target = target if target is not None else routing.quality_target
    if target is None:
        raise ValueError(f"alias '{alias}' has no quality_target: pass --target")
    sha = model_sha256(settings.models.local[settings.aliases[alias].local].gguf)
    examples = asyncio.run(stored_examples(settings.store, learning_key(alias, sha)))
    meta = {"source": f"python -m gateway tune --from-examples: {len(examples)} examples of alias {alias}"}
    candidate = fit_candidate(examples, held_out, target, sha, meta)
    if candidate is None:
        raise ValueError(f"alias '{alias}' has {len(examples)} examples: too few, or all of one label, to fit "
                         "and rate a check")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / CHECK_FILE, candidate.check.to_json())
    snippet = {alias: {"routing": {"answer_check": str(out / CHECK_FILE), "escalate_below": candidate.bar.value}}}
    (out / SNIPPET_FILE).write_text(yaml.safe_dump(snippet, sort_keys=False))
    (out / REPORT_FILE).write_text(report(alias, target, examples, candidate))
    return candidate


async def stored_examples(store: StoreSettings, key: str) -> list[Example]:
    """The learning examples a gateway keeps under `key` (gateway.shadow.learning.learning_key) in the
    Redis store `store` names, oldest first; ValueError for a memory store."""
    if store.backend != "redis":
        raise ValueError("--from-examples reads the examples a gateway keeps in Redis (store.backend: redis); "
                         "a memory store's live only in its gateway's process")
    redis = RedisStore(store.url, store.key_prefix, store.timeout_s, store.reservation_ttl_s, store.cache_ttl_s)
    try:
        kept, _ = await redis.examples_read(key)
    finally:
        await redis.close()
    return [Example.of_json(json.loads(text)) for text in kept]


def report(alias: str, target: float, examples: list[Example], candidate: Candidate) -> str:
    bar = candidate.bar
    agreeing = sum(e.agreed for e in examples)
    lines: list[Any] = [
        f"# Answer check of alias {alias}, fitted on its examples", "",
        f"- examples: {len(examples)} ({agreeing} whose local answer agreed with the upstream's), "
        f"fitted on {candidate.fitted_on}, held out {candidate.held_out}",
        f"- held-out ranking (AUC): {candidate.auc:.3f}",
        f"- escalate_below {bar.value:.4f} for quality_target {target}: asks {bar.escalated_share:.1%} of "
        f"held-out answers afresh; agreement {bar.agreement:.3f}, Wilson 95% lower bound {bar.agreement_low:.3f}",
    ]
    return "\n".join(lines) + "\n"
