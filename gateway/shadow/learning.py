"""Routing that learns on its own traffic (docs/routing.md, "Routing that learns"): an alias with
`routing.learn` turns its shadow samples into labelled examples, fits an answer check on them in the
background, and holds its quality target with it.

Every replica writes examples into one list in the Store (per alias and local-model sha256, the
newest `learn.keep`), and every replica's background pass (`CheckLearner.refit`) may fit a candidate;
promotion is a compare-and-set on the one promoted state in the Store (`learned_swap`), so all
replicas rate answers with the same version (`PromotedState`, one record per alias and model). The math is policies/online_check.py's.

What the alias runs (`CheckLearner.routing_of`): before a check is promoted, or after one decays, its
cold start: `upstream` (the live check rates every answer 0 and escalate_below is 1: every answer
that does not stream is asked afresh) or `agreement` (the agreement check at 0.75); once one is
promoted, that check with the bar chosen for it. Either way every held answer is rated, so its
stats and text before escalation reach the shadow case (cases.LocalAnswer) and can be labelled.

A record in the Store that this gateway cannot read (another version's fields, a check that does
not load) is treated as none, with one warning: the alias runs its cold start, and its next
promotion replaces the record.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from adapters.model_files import model_sha256
from adapters.store import Store, StoreUnavailable
from gateway.settings import AgreementSettings, LearnSettings, RoutingSettings
from gateway.shadow.cases import LocalAnswer, ShadowCase
from policies.agreement import answer_format
from policies.answer_check import AnswerStats
from policies.online_check import (
    AGREEMENT_FEATURES,
    LEARNED_FEATURES,
    AnswerInputs,
    Bar,
    Example,
    LearnedCheck,
    auc,
    choose_bar,
    fit_candidate,
    promotes,
    rate,
    split,
)

log = logging.getLogger("gateway.shadow")

LEARNED_CHECK = "learned"  # routing.answer_check while the learned check rates answers (no file: the live one)
COLD_AGREEMENT = {"answer_check": AgreementSettings(kind="agreement", samples=4), "escalate_below": 0.75}
HISTORY = 20  # fits whose figures the promoted state keeps
# What a fit reads: the learned check routes with no samples beside it (`routing_of` replaces the
# answer check), so no answer it rates has an agreement share; one learned from the agreement cold
# start's shares would be rated on a signal it never sees.
FITTED_FEATURES = tuple(name for name in LEARNED_FEATURES if name not in AGREEMENT_FEATURES)


class LiveCheck:
    """The alias's answer check as the decoder reads it: the promoted version, or none, which rates
    every answer 0 (with escalate_below 1: every held answer is asked afresh)."""

    at_tokens = None  # rated when the answer ends
    reads_inputs = True  # the decoder hands it AnswerInputs (gateway/decoding/review.py)

    def __init__(self) -> None:
        self.current: LearnedCheck | None = None

    def confidence(self, answer: AnswerStats | AnswerInputs) -> float:
        """The promoted check's confidence that `answer` agrees with upstream-only's, read with the
        features it was fitted on (0 with none: the cold start asks it afresh). Never raises;
        called on the decoding path."""
        return 0.0 if self.current is None else self.current.confidence(answer)


class BarFigures(BaseModel):
    """A promoted check's bar (escalate_below) and what its held-out examples said it gives."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    value: float
    escalated_share: float
    agreement: float
    agreement_low: float
    held_out: int


class PromotedState(BaseModel):
    """The promoted state in the Store, one record per alias and local model: the version and its
    check (None: cold start), its figures, where learning (re)started (`since`: examples ever added
    then) and the last fits' figures. Frozen; `text()` is what the compare-and-set compares."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = 0
    check: dict[str, Any] | None = None  # LearnedCheck.to_json(): its "features" name what it was fitted on
    auc: float | None = None  # held-out ranking when last measured
    bar: BarFigures | None = None
    fitted_on: int = 0  # examples the check was fitted on (a tie promotes only a check fitted on more)
    promoted_at: int = 0  # examples ever added when promoted
    since: int = 0
    fitted_at: int = 0  # examples ever added at the last fit
    live_auc: float | None = None
    history: tuple[dict[str, Any], ...] = ()

    def text(self) -> str:
        """The record as the Store keeps it (JSON)."""
        return self.model_dump_json()

    @classmethod
    def of(cls, text: str | None, where: str = "") -> "PromotedState":
        """The state of the record `text` (None or empty: none yet). A record this gateway cannot
        read (not JSON, an unknown field, a wrong type) is refused with a warning naming `where`,
        and reads as none. Never raises."""
        if not text:
            return cls()
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            log.warning("learned state %s in the store is not one this gateway reads, treated as none: %s",
                        where, _one_line(exc))
            return cls()


@dataclass
class CheckLearner:
    """One alias's learning of its answer check (see the module docstring); shared by the shadow
    services a reload replaces while the alias's model and routing stay."""

    alias: str
    settings: LearnSettings
    target: float
    model_sha256: str
    tenant_share: float | None  # None: one tenant feeds the alias, no share to keep (the shadow service sets it)
    live: LiveCheck = field(default_factory=LiveCheck)
    state: PromotedState = field(default_factory=PromotedState)
    state_text: str | None = None  # the state's record as last read (the compare-and-set's expectation)
    examples: int = 0  # examples ever added, as last read
    refused_by_share: int = 0  # samples past the tenant's share, in this process

    @property
    def version(self) -> int | None:
        """The promoted version routing now (None: the cold start)."""
        return self.state.version if self.live.current is not None else None

    @property
    def key(self) -> str:
        """The Store key of this alias's examples and promoted state (`learning_key`)."""
        return learning_key(self.alias, self.model_sha256)

    def routing_of(self, routing: RoutingSettings) -> RoutingSettings:
        """`routing` as the alias runs it now: the learned check with its bar, or the cold start."""
        if self.live.current is not None and self.state.bar is not None:
            return routing.model_copy(update={"answer_check": LEARNED_CHECK, "escalate_below": self.state.bar.value})
        if self.settings.cold_start == "agreement":
            return routing.model_copy(update=COLD_AGREEMENT)
        return routing.model_copy(update={"answer_check": LEARNED_CHECK, "escalate_below": 1.0})

    def rate(self, settled_rate: float) -> float:
        """The shadow rate: `learning_rate` until a check is promoted, then the alias's own."""
        return settled_rate if self.live.current is not None else self.settings.learning_rate

    async def add(self, store: Store, case: ShadowCase, local: LocalAnswer, agreed: bool, fmt: str) -> bool:
        """Keep one example of `case` (whose local answer `agreed` with the upstream's direct one);
        whether the store took it (not past the tenant's share). Raises StoreUnavailable."""
        example = example_of(local, agreed, fmt, case.tenant)
        kept = await store.examples_add(self.key, json.dumps(example.to_json()), case.tenant, self.tenant_share,
                                        self.settings.keep)
        self.refused_by_share += not kept
        return kept

    async def refit(self, store: Store) -> None:
        """One background pass: read the examples and the promoted state; drop a check whose live
        ranking decayed, or fit a candidate (on a worker thread) and promote it if it ranks at
        least as well (`promotes`). Raises StoreUnavailable."""
        kept, total = await store.examples_read(self.key)
        self._install(await store.learned_read(self.key))
        self.examples = total
        examples = readable_examples(kept, total)
        usable = [e for index, e in examples if index >= self.state.since]
        if self.live.current is not None and await self._decayed(store, examples, total):
            return
        due = total - self.state.fitted_at >= self.settings.refit_every
        if due and len(usable) >= self.settings.min_examples:
            await self._fit(store, usable, total)

    async def sync(self, store: Store) -> None:
        """Read the promoted state (another replica may have promoted); a record this gateway cannot
        read is none (see the module docstring). Raises StoreUnavailable."""
        self._install(await store.learned_read(self.key))

    def _install(self, text: str | None) -> None:
        if text == self.state_text:
            return
        state = PromotedState.of(text, self.key)
        check = None
        if state.check is not None:
            try:
                check = LearnedCheck.of_json(state.check, f"learned check {self.key}", self.model_sha256)
            except (ValueError, TypeError, KeyError) as exc:  # RouterError is a ValueError
                log.warning("learned check %s in the store does not load here, treated as none: %s", self.key, exc)
                state = PromotedState()
        self.state_text, self.state, self.live.current = text, state, check

    async def _decayed(self, store: Store, examples: list[tuple[int, Example]], total: int) -> bool:
        """Whether the promoted check's ranking on the examples after its promotion fell below
        `decay_auc` (then the cold start runs and learning starts again from here)."""
        after = [e for index, e in examples if index >= self.state.promoted_at][-self.settings.live_window:]
        if len(after) < self.settings.live_window:
            return False
        live = auc(*rate(self.live.current, after))
        if live is None or live >= self.settings.decay_auc:
            await self._swap(store, self.state.model_copy(update={"live_auc": live}))
            return False
        log.warning("learned check of alias %s (version %s) ranks %.3f on its last %d examples, below %s: "
                    "back to cold start", self.alias, self.state.version, live, len(after), self.settings.decay_auc)
        entry = {"version": self.state.version, "event": "decayed", "live_auc": round(live, 4), "examples": total}
        await self._swap(store, PromotedState(version=self.state.version, since=total, fitted_at=total,
                                              history=(*self.state.history, entry)[-HISTORY:]))
        return True

    async def _fit(self, store: Store, usable: Sequence[Example], total: int) -> None:
        meta = {"source": f"learned online from alias {self.alias}'s shadow samples", "examples": total}
        # up to `keep` rows and 30 Newton steps: off the event loop
        candidate = await asyncio.to_thread(fit_candidate, usable, self.settings.held_out, self.target,
                                            self.model_sha256, meta, FITTED_FEATURES)
        if candidate is None:
            return
        _, held = split(usable, self.settings.held_out)
        current = self.live.current
        current_auc = auc(*rate(current, held)) if current is not None else None
        promoted = promotes(candidate.auc, current_auc, candidate.fitted_on > self.state.fitted_on) \
            and candidate.check.to_json() != self.state.check  # the same check again is no new version
        entry = {"version": self.state.version + 1, "examples": total, "fitted_on": candidate.fitted_on,
                 "held_out": candidate.held_out, "auc": _round(candidate.auc), "current_auc": _round(current_auc),
                 "bar": candidate.bar.value, "promoted": promoted}
        history = (*self.state.history, entry)[-HISTORY:]
        if promoted:
            state = PromotedState(version=self.state.version + 1, check=candidate.check.to_json(), auc=candidate.auc,
                                  bar=_bar(candidate.bar), fitted_on=candidate.fitted_on, promoted_at=total,
                                  since=self.state.since, fitted_at=total, history=history)
            log.info("alias %s promotes learned check version %s: held-out AUC %.3f (current %s), bar %.3f",
                     self.alias, state.version, candidate.auc, current_auc, candidate.bar.value)
        else:
            bar = _bar(choose_bar(*rate(current, held), self.target)) if current is not None else None
            state = self.state.model_copy(update={"auc": current_auc, "bar": bar, "fitted_at": total,
                                                  "history": history})
        await self._swap(store, state)

    async def _swap(self, store: Store, state: PromotedState) -> None:
        """Write `state` in place of the one last read, unless it is the same (no write)."""
        if state == self.state:
            return
        text = state.text()
        if await store.learned_swap(self.key, text, self.state_text):
            self._install(text)
        else:
            self._install(await store.learned_read(self.key))  # another replica wrote first: take its state

    def report(self) -> dict[str, Any]:
        """The learning state for GET /admin/quality (the store's figures are the caller's)."""
        state = self.state
        return {"state": "settled" if self.live.current is not None else "cold_start",
                "cold_start": self.settings.cold_start, "model_sha256": self.model_sha256, "key": self.key,
                "examples": self.examples, "learning_since": state.since, "min_examples": self.settings.min_examples,
                "version": state.version if self.live.current is not None else None,
                "held_out_auc": _round(state.auc), "live_auc": _round(state.live_auc),
                "bar": state.bar.model_dump() if state.bar is not None else None,
                "refused_tenant_share": self.refused_by_share, "fits": list(state.history)}


def learner_of(alias: str, routing: RoutingSettings, gguf: str) -> CheckLearner:
    """The learner of `alias` (its local model's file `gguf`, hashed unless a catalog name), with
    no tenant share until the shadow service counts the tenants that feed it; cold until its
    first read of the Store."""
    return CheckLearner(alias, routing.learn, routing.quality_target, model_sha256(gguf), None)


async def keep_learning(learner: CheckLearner, store: Store, calls: Counter[str]) -> None:
    """Run until cancelled: every `learn.refit_s`, one learning pass (`CheckLearner.refit`); a store
    fault waits for the next pass, any other is logged and the next pass runs. `calls` counts the store reads."""
    while True:
        await asyncio.sleep(learner.settings.refit_s)
        try:
            calls["read"] += 2
            await learner.refit(store)
        except StoreUnavailable:
            continue
        except Exception:  # noqa: BLE001 - one bad pass must not stop learning
            log.exception("learning pass of alias %s failed", learner.alias)


def readable_examples(kept: Sequence[str], total: int) -> list[tuple[int, Example]]:
    """The stored examples (`kept`, the newest of `total` ever added) with their index in the
    stream; one this gateway cannot read (another version's) is left out."""
    examples = []
    for offset, text in enumerate(kept):
        try:
            examples.append((total - len(kept) + offset, Example.of_json(json.loads(text))))
        except (ValueError, KeyError, TypeError):
            continue
    return examples


def learning_key(alias: str, model_sha256: str) -> str:
    """The Store key of an alias's examples and learned check, for one local model."""
    return f"{alias}:{model_sha256[:16]}"


def example_of(local: LocalAnswer, agreed: bool, fmt: str, tenant: str) -> Example:
    """The example of one shadow sample: the local answer's features, whether it agreed, and
    lengths, agreement share, the format it was compared in (`fmt`) and its own (`answer_format`, as
    the learned check reads it where it rates) beside them (never text)."""
    extra = {"tenant": tenant, "format": fmt, "answer_format": answer_format(local.text),
             "agreement": local.agreement, "prompt_tokens": local.prompt_tokens,
             "answer_tokens": local.stats.answer_tokens, "answer_chars": len(local.text), "t": round(time.time(), 3)}
    return Example(uuid.uuid4().hex, tuple(float(v) for v in local.stats.features()), agreed, extra)


def _bar(bar: Bar) -> BarFigures:
    return BarFigures(value=round(bar.value, 6), escalated_share=round(bar.escalated_share, 4),
                      agreement=round(bar.agreement, 4), agreement_low=round(bar.agreement_low, 4), held_out=bar.n)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _one_line(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors()[:3])
