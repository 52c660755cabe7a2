"""Run a dataset through the real decoder for several configurations, resumably.

Each item goes through every config in turn, so a run stopped at any point has all configs on the
same items (give or take those in flight). With `parallel` > 1 that many items decode at once, on
sequences of their own in the local model's batched engine. Each finished item is one JSONL
line; items already recorded are skipped, so the same command resumes a run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.chat_template import TemplateError
from adapters.grammar import gbnf_for
from adapters.local_model import ContextOverflow
from adapters.memory_store import MemoryStore
from adapters.store import Limits
from fitting.analysis import TeacherForcer
from fitting.answers import score
from fitting.configs import ConfigSpec
from fitting.datasets import Item
from fitting.oracle import Oracle, local_mismatches, reanchorer
from fitting.records import append_record, configs_in, datasets_in, read_records, records_path, write_json
from fitting.session import Models
from fitting.summary import summarize
from gateway.decoding.cost_ceiling import CostCeiling, cost_ratio
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.decoding.values import RequestRouting
from gateway.settings.routing_values import AnswerReview, CeilingRule, HandoffRule
from gateway.tenancy.budget import HandoffGate, Ledger
from policies import Policy, Signal
from policies.agreement import AgreementCheck

KEEP_TOKENS = ("never", "always")  # configs whose answer token ids are kept (analysis, oracle)


@dataclass(frozen=True)
class RunPlan:
    dataset: str
    items: list[Item]
    configs: list[ConfigSpec]
    run_dir: Path
    max_tokens: int
    block: int = 25
    parallel: int = 1  # items decoded at once


def pending(plan: RunPlan) -> dict[str, set[str]]:
    """Config name -> ids of the plan's items that still need decoding."""
    wanted = {item.id for item in plan.items}
    todo = {}
    for spec in plan.configs:
        done = {r["id"] for r in read_records(records_path(plan.run_dir, plan.dataset, spec.name))}
        todo[spec.name] = wanted - done
    return todo


async def run(plan: RunPlan, models: Models, on_item: Callable[[str], None] = lambda name: None) -> dict[str, Any]:
    """Decode every pending (config, item) of the plan; return the run directory's summary.

    Within a block each item goes through every config before the next item: the upstream
    server and the local context then keep the item's prompt in their KV caches across configs
    instead of evaluating it again for each one.
    """
    todo = pending(plan)
    references = {r["id"]: r for r in read_records(records_path(plan.run_dir, plan.dataset, "upstream"))}
    forcer = _forcer(models, plan)
    try:
        await _run_blocks(plan, models, todo, references, forcer, on_item)
    finally:
        if forcer is not None:
            forcer.close()
    return write_summary(plan.run_dir)


def _forcer(models: Models, plan: RunPlan) -> TeacherForcer | None:
    """A teacher-forcing context for the oracle's re-anchoring (None: the oracle cannot re-anchor)."""
    wanted = any(spec.policy == "oracle" for spec in plan.configs)
    if not wanted or models.local_path is None or models.upstream is None:
        return None
    return TeacherForcer.load(models.local_path, n_ctx=min(models.local.n_ctx, 1024), threads=1)


async def _run_blocks(plan: RunPlan, models: Models, todo: dict[str, set[str]], references: dict[str, Any],
                      forcer: TeacherForcer | None, on_item: Callable[[str], None]) -> None:
    lanes = asyncio.Semaphore(plan.parallel)

    async def one_item(item: Item) -> bool:
        async with lanes:
            return await _run_item(plan, models, item, todo, references, forcer, on_item)

    for start in range(0, len(plan.items), plan.block):
        decoded = await asyncio.gather(*(one_item(item) for item in plan.items[start:start + plan.block]))
        if any(decoded):
            write_summary(plan.run_dir)


async def _run_item(plan: RunPlan, models: Models, item: Item, todo: dict[str, set[str]], references: dict[str, Any],
                    forcer: TeacherForcer | None, on_item: Callable[[str], None]) -> bool:
    """Every pending config of one item, in order (the oracle needs the upstream's answer first)."""
    decoded = False
    for spec in plan.configs:
        if item.id not in todo[spec.name]:
            continue
        record = await evaluate(models, plan, spec, item, references.get(item.id), forcer)
        if spec.uses_upstream and "upstream_unavailable" in record["degraded"]:
            # a dead upstream would quietly turn the config into local-only: stop instead
            raise RuntimeError(f"upstream unavailable at {spec.name} item {item.id}; rerun to resume")
        append_record(records_path(plan.run_dir, plan.dataset, spec.name), record)
        if spec.policy == "always":
            references[item.id] = record
        decoded = True
        on_item(spec.name)
    return decoded


def write_summary(run_dir: Path) -> dict[str, Any]:
    """Summaries of every (dataset, config) in `run_dir`, written to its summary.json."""
    summary = {
        dataset: {name: summarize(read_records(path)) for name, path in configs_in(run_dir, dataset).items()}
        for dataset in datasets_in(run_dir)
    }
    write_json(run_dir / "summary.json", summary)
    return summary


async def evaluate(models: Models, plan: RunPlan, spec: ConfigSpec, item: Item,
                   reference: dict[str, Any] | None, forcer: TeacherForcer | None = None) -> dict[str, Any]:
    """Decode one item under one config and score it: the record written to the JSONL."""
    oracle = None
    if spec.policy == "oracle":
        oracle = await _oracle(models, item, reference, forcer, plan.max_tokens)
        policy: Policy = oracle
    else:
        policy = spec.policy_object(models.router)
    grammar = gbnf_for("json_schema", item.meta["schema"]) if "schema" in item.meta else None
    priced = spec.uses_upstream and models.upstream is not None  # every routed answer reports its cost ratio
    rule = CeilingRule(spec.max_cost_ratio, spec.on_ceiling)
    ceiling = CostCeiling(rule, models.upstream.prices, 0) if priced else None
    check = AgreementCheck(spec.agree, answer=spec.keep) if spec.agree else models.check
    routing = RequestRouting(policy, HandoffRule(spec.span(plan.max_tokens), spec.until), ceiling,
                             AnswerReview(check, spec.escalate_below, spec.escalation, held=True),
                             answer_lengths=spec.windows.answer_lengths)
    request = DecodeRequest(messages=item.messages, max_tokens=plan.max_tokens, routing=routing, grammar=grammar)
    record: dict[str, Any] = {"id": item.id, "row": item.row, "config": spec.name, "dataset": plan.dataset,
                              "gold": item.gold}
    if spec.uses_upstream and plan.parallel == 1:  # with items in flight together, their sequences stay
        await models.cold_upstream()
    try:
        decoding = Decoding(models.local, models.upstream if spec.uses_upstream else None, _gate(), request)
    except (ContextOverflow, TemplateError) as exc:
        return {**record, **_failed(str(exc))}
    if oracle is not None:
        oracle.answer = lambda: decoding.answer_tokens
    started = time.monotonic()
    signals = [piece.signal async for piece in decoding.pieces() if piece.signal is not None]
    wall = time.monotonic() - started - (oracle.knowledge_s if oracle else 0.0)
    record.update(_outcome(plan.dataset, item, decoding, wall, signals))
    if spec.policy in KEEP_TOKENS:
        record["tokens"] = decoding.answer_tokens
    if oracle is not None:
        record["oracle"] = oracle.summary()
    return record


async def _oracle(models: Models, item: Item, reference: dict[str, Any] | None, forcer: TeacherForcer | None,
                  max_tokens: int) -> Oracle:
    if reference is None:
        raise RuntimeError(f"oracle: no upstream answer recorded for item {item.id}")
    local = models.local
    prompt = local.tokenize_prompt(local.template.render_parts(item.messages))
    tokens = reference["tokens"]
    mismatch = await local_mismatches(local, prompt, tokens, ended=reference["finish_reason"] == "stop")
    reanchor = reanchorer(local, models.upstream, forcer, item, max_tokens) if forcer is not None else None
    return Oracle(tokens, mismatch, reanchor=reanchor)


def _gate() -> HandoffGate:
    """A fresh, unlimited gate per item: no budget caps and no cache shared across items."""
    return HandoffGate(Ledger(MemoryStore()), "eval", Limits(), allowed=True)


def _outcome(dataset: str, item: Item, decoding: Decoding, wall: float, signals: list[Signal]) -> dict[str, Any]:
    text = decoding.text.text
    scored = score(dataset, item, text)
    counts, usage = decoding.source_counts(), decoding.usage
    entropies = [s.entropy for s in signals] or [0.0]
    return {
        "text": text, "pred": scored.pred, "correct": scored.correct, "rule": scored.rule,
        "answer_tokens": len(decoding.answer_tokens), "local_tokens": counts["local"],
        "upstream_tokens": counts["upstream"], "cache_tokens": counts["cache"],
        "sources": "".join(source[0].upper() for source in decoding.sources),
        "upstream_calls": usage.upstream_calls, "upstream_prompt_tokens": usage.upstream_prompt_tokens,
        "upstream_completion_tokens": usage.upstream_completion_tokens,
        "upstream_cached_tokens": usage.upstream_cached_tokens,
        "upstream_compute_ms": round(usage.upstream_compute_ms, 1),
        "upstream_cost_usd": usage.upstream_cost_usd, "degraded": list(usage.degraded),
        "upstream_predicted_cost_usd": usage.predicted_cost_usd, "cost_ratio": cost_ratio([decoding]),
        "escalated": usage.escalated, "price_vetoes": usage.price_vetoes, "afresh": usage.afresh,
        "draft_hand_offs": usage.draft_hand_offs,
        "discarded_tokens": usage.discarded_tokens, "answer_confidence": usage.answer_confidence,
        "agreement": usage.agreement, "majority": usage.majority, "sample_tokens": usage.sample_tokens,
        "finish_reason": decoding.finish_reason, "wall_s": round(wall, 4),
        "prompt_tokens": len(decoding.prompt_tokens),
        "mean_entropy": round(statistics.fmean(entropies), 5), "max_entropy": round(max(entropies), 5),
        "first_entropy": round(entropies[0], 5),
        "mean_top1": round(statistics.fmean(s.top1 for s in signals), 5) if signals else 1.0,
    }


def _failed(reason: str) -> dict[str, Any]:
    """The record of an item that could not be decoded (it counts as wrong)."""
    return {
        "text": "", "pred": None, "correct": False, "rule": "none", "error": reason,
        "answer_tokens": 0, "local_tokens": 0, "upstream_tokens": 0, "cache_tokens": 0, "sources": "",
        "upstream_calls": 0, "upstream_prompt_tokens": 0, "upstream_completion_tokens": 0,
        "upstream_cached_tokens": 0, "upstream_compute_ms": 0.0,
        "upstream_cost_usd": 0.0, "degraded": ["error"], "finish_reason": "error", "wall_s": 0.0,
        "prompt_tokens": 0, "mean_entropy": 0.0, "max_entropy": 0.0, "first_entropy": 0.0, "mean_top1": 1.0,
    }
