"""The agreement check: final answers by format, and the local model's own samples decoded beside
the greedy answer (policies/agreement.py, gateway/decoding/agreement_samples.py)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from adapters.memory_store import MemoryStore
from adapters.store import Limits
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.decoding.values import RequestRouting
from gateway.settings import RoutingOverride, RoutingSettings
from gateway.settings.routing_values import AnswerReview
from gateway.tenancy.budget import HandoffGate, Ledger
from policies.agreement import AgreementCheck, agreement, answer_format, final_answer, majority, same_answer
from tests.conftest import ADMIN_KEY, gateway_config, live_gateway
from tests.fakes import FakeLocalModel, FakeUpstream
from tests.test_decoder import VOCAB, invariant, run


@pytest.mark.parametrize(("text", "fmt", "final"), [
    ("She pays 3 * $4 = $12.\nAnswer: 1,200", "number", "1200"),
    ("#### 42.0", "number", "42"),
    ("\\boxed{7} and then 9 more", "number", "7"),
    ("It costs 5 dollars, then 8.", "number", "8"),
    ("B. library - books are kept there", "letter", "B"),
    ("**(C)**", "letter", "C"),
    ("I think the answer is (D) because", "letter", "D"),
    ("```python\n# add\ndef f(a, b):\n    return a + b   \n\n```", "code", "def f(a, b):\n    return a + b"),
    ("Hello, World!  Again.", "text", "hello world again"),
])
def test_final_answers_are_read_by_format(text, fmt, final):
    assert answer_format(text) == fmt
    assert final_answer(text) == final


def test_answers_agree_by_their_final_answer_not_their_wording():
    assert same_answer("So 3 + 4 = 7.\nAnswer: 7", "Seven it is. 7.0")
    assert not same_answer("Answer: 7", "Answer: 8")
    assert same_answer("A. bank", "A) the bank, where money is")
    assert not same_answer("A. bank", "Nothing here")  # no letter: agrees with nothing
    assert same_answer("```\n# one\nx = 1\n\n```", "```python\nx = 1   \n```")
    assert same_answer("the quick brown fox jumps", "the quick brown fox leaps", "text")  # 4 of 6 words
    assert not same_answer("the quick brown fox", "a slow red dog", "text")
    assert agreement("Answer: 7", ["7", "Answer: 7", "8"]) == pytest.approx(2 / 3)
    assert agreement("Answer: 7", []) == 1.0


def test_the_majority_is_the_answer_most_of_the_others_agree_with():
    assert majority(["A. bank", "B. park", "(B)", "B: a park"], "letter") == (1, pytest.approx(2 / 3))
    assert majority(["A. bank", "B. park", "A) bank", "C"], "letter") == (0, pytest.approx(1 / 3))  # tie: greedy
    assert majority(["Answer: 7", "8", "9"]) == (0, 0.0)  # nobody agrees: the greedy answer
    assert majority(["Answer: 7"]) == (0, 1.0)


class SplitVote(FakeLocalModel):
    """Its likeliest first token is "A." (p 0.27), but "B" spelt three ways holds 0.73 between them:
    the greedy answer is A, most sampled answers say B. Every answer ends after its first token."""

    def __init__(self) -> None:
        super().__init__(["A.", "B.", "(B)", "B:"], "")

    async def forward(self, tokens: list[int]) -> np.ndarray:
        logits = np.full(len(self.vocab), -30.0, dtype=np.float32)
        if len(tokens) > self.prompt_length:
            logits[0] = 20.0  # the end
        else:
            logits[1:] = (1.0, 0.9, 0.9, 0.9)
        return logits


@pytest.mark.parametrize(("kept", "held", "answer"), [
    ("majority", True, "B"), ("majority", False, "A"), ("greedy", True, "A")])
async def test_a_held_answer_may_keep_the_majority_answer(kept, held, answer):
    check = AgreementCheck(samples=8, temperature=1.0, format="letter", answer=kept)
    checked = decoding_with_check(SplitVote(), None, check, held=held, escalate_below=None)
    text = "".join(p.text for p in await run(checked))
    assert final_answer(text, "letter") == answer and checked.usage.majority == (answer == "B")
    answers = ["A.", *[sample for sample, _ in await checked._samples.answers()]]  # the greedy one first
    assert sum(final_answer(a, "letter") == "B" for a in answers) > len(answers) / 2  # B is the majority's
    others = list(answers)
    others.remove(text)
    assert checked.usage.agreement == pytest.approx(agreement(text, others, "letter"), abs=1e-4)
    assert checked.source_counts()["local"] == len(checked.answer_tokens) == 1
    invariant(checked)


def decoding_with_check(local, upstream, check: AgreementCheck, held: bool = True, escalate_below: float | None = 0.5):
    gate = HandoffGate(Ledger(MemoryStore()), "t", Limits(), allowed=True)
    review = AnswerReview(check, escalate_below=escalate_below, held=held)
    request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=20,
                            routing=RequestRouting(review=review), seed=3)
    return Decoding(local, upstream, gate, request)


async def test_samples_decode_beside_the_greedy_answer_which_they_leave_unchanged():
    plain = decoding_with_check(FakeLocalModel(VOCAB, "Paris is nice."), None, None, escalate_below=None)
    await run(plain)
    local = FakeLocalModel(VOCAB, "Paris is nice.")  # sure of every token: samples write the same
    checked = decoding_with_check(local, FakeUpstream("Paris is big."), AgreementCheck(samples=4))
    pieces = await run(checked)
    assert "".join(p.text for p in pieces) == "Paris is nice." == bytes(plain.answer_bytes).decode()
    assert checked.usage.samples == 4 and checked.usage.agreement == 1.0 == checked.usage.answer_confidence
    assert checked.usage.sample_tokens == 3 * len(checked.answer_tokens)
    assert not checked.usage.afresh and checked.upstream.calls == []


async def test_an_answer_its_samples_disagree_with_is_asked_afresh():
    # unsure of the first three tokens (a greedy guess still follows the target): samples wander off
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({0, 1, 2}), lean=0.5)
    upstream = FakeUpstream("Paris is big.")
    checked = decoding_with_check(local, upstream, AgreementCheck(samples=4, temperature=1.0, format="text"))
    pieces = await run(checked)
    assert checked.usage.agreement < 0.5 and checked.usage.afresh
    assert "".join(p.text for p in pieces) == "Paris is big."


async def test_a_streamed_answer_is_rated_but_not_replaced():
    local = FakeLocalModel(VOCAB, "Paris is nice.", uncertain_at=frozenset({0, 1, 2}), lean=0.5)
    checked = decoding_with_check(local, FakeUpstream("Paris is big."), AgreementCheck(samples=3, temperature=1.0),
                                  held=False)
    pieces = await run(checked)
    assert "".join(p.text for p in pieces) == "Paris is nice."
    assert checked.usage.agreement is not None and not checked.usage.afresh


def test_the_check_is_configured_or_asked_for_and_bad_values_name_the_field():
    routing = RoutingSettings(policy="never", answer_check={"kind": "agreement", "samples": 3}, escalate_below=0.5)
    assert routing.answer_check.samples == 3 and routing.answer_check.temperature == 0.7
    # the request's review: this check (not the alias's file), its bar, and the routing's escalation
    assert routing.review(fitted=None, held=True) == AnswerReview(AgreementCheck(samples=3), 0.5, "continue", True)
    for bad, field in (({"kind": "agreement", "samples": 1}, "samples"), ({"kind": "agreement", "temperature": 0}, "temperature"),
                       ({"kind": "agreement", "format": "essay"}, "format"), ({"kind": "vote"}, "kind"),
                       ({"kind": "agreement", "answer": "mode"}, "answer")):
        with pytest.raises(ValidationError) as refused:
            RoutingOverride(answer_check=bad)
        assert refused.value.errors()[0]["loc"] == ("answer_check", field)
    with pytest.raises(ValidationError):  # a file is the configuration's to name, never a request's
        RoutingOverride(answer_check="/etc/passwd")


@pytest.mark.integration
def test_a_real_gateway_reports_the_agreement_of_its_answers(tmp_path):
    config = gateway_config(None)
    config["aliases"]["local"]["routing"]["answer_check"] = {"kind": "agreement", "samples": 3}
    with live_gateway(config, tmp_path) as gateway:
        answer = gateway.client().chat.completions.create(
            model="local", messages=[{"role": "user", "content": "What is 2 + 3? Answer with the number."}],
            max_tokens=12, temperature=0)
        routing = answer.usage.model_extra["routing"]
        assert routing["samples"] == 3 and 0.0 <= routing["agreement"] <= 1.0
        assert routing["sample_tokens"] > 0 and routing["upstream_calls"] == 0
        asked = gateway.client().chat.completions.create(
            model="local", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
            extra_body={"routing": {"answer_check": {"kind": "agreement", "samples": 2, "format": "text",
                                                     "answer": "majority"}}})
        assert asked.usage.model_extra["routing"]["samples"] == 2
        assert asked.usage.model_extra["routing"]["majority"] is False  # of two answers a tie: the greedy one
        metrics = httpx.get(f"{gateway.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
        assert 'gateway_answer_agreement_count{alias="local"} 2.0' in metrics
        assert 'gateway_agreement_sample_tokens_total{alias="local"}' in metrics
        assert 'gateway_agreement_majority_answers_total{alias="local"} 0.0' in metrics


class OneSequence(FakeLocalModel):
    """An engine of one sequence: a request waits for it while another holds it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slots = asyncio.Semaphore(1)

    @contextlib.asynccontextmanager
    async def sequence(self, *args, **kwargs):
        async with self.slots, super().sequence(*args, **kwargs) as sequence:
            yield sequence


async def test_samples_that_need_the_greedy_answers_sequence_get_it():
    """With fewer engine sequences than answers, a greedy answer waiting for its samples while
    holding its sequence would wait forever: it waits holding none. Two requests, one sequence."""
    local = OneSequence(VOCAB, "Paris is nice.")
    checked = [decoding_with_check(local, FakeUpstream("Paris is big."), AgreementCheck(samples=3)) for _ in range(2)]
    await asyncio.wait_for(asyncio.gather(*(run(d) for d in checked)), timeout=10)
    assert [d.usage.agreement for d in checked] == [1.0, 1.0]
