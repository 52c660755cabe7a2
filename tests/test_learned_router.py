"""The learned router: features from the decoder's own signals, training, the model-hash check, serving."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adapters.memory_store import MemoryStore
from adapters.store import Limits
from eval.__main__ import main as eval_main
from fitting.analysis import steps
from fitting.learn import compare, matrix, step_signal, train, with_thresholds
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.decoding.signals import signal_of, token_kind
from gateway.decoding.values import RequestRouting
from gateway.settings import RoutingOverride, RoutingSettings
from gateway.tenancy.budget import HandoffGate, Ledger
from gateway.tenancy.routing import resolve_routing
from gateway.wire.errors import InvalidRequest
from policies import LOCAL, UPSTREAM, RecentValues, RoutingState, SharedWindows, build_policy
from policies.base import PolicyDefaults
from policies.learned import FEATURES, Router, RouterError, features
from tests.fakes import FakeLocalModel, synthetic

VOCAB = ["Paris", " is", " nice", " 42", ".", "\n", *sorted(set("Paris is nice 42."))]


class Recording(PolicyDefaults):
    """A policy that routes nothing and keeps every (detailed) signal it is shown."""

    name = "recording"
    detailed_signal = True

    def __init__(self) -> None:
        self.signals = []

    def decide(self, signal, state):
        self.signals.append(signal)
        return LOCAL


async def test_features_are_read_from_the_decoders_own_signals():
    local = FakeLocalModel(VOCAB, "Paris is 42.\nnice", uncertain_at=frozenset({1, 3}), lean=1.0)
    policy = Recording()
    request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=12, routing=RequestRouting(policy))
    decoding = Decoding(local, None, HandoffGate(Ledger(MemoryStore()), "t", Limits(), allowed=True), request)
    [piece async for piece in decoding.pieces()]
    assert decoding.finish_reason == "stop"
    assert len(policy.signals) == len(decoding.answer_tokens) + 1  # plus the step that ended the answer
    for position, (signal, logits) in enumerate(zip(policy.signals, [
            await local.forward(local.forwards[i]) for i in range(len(policy.signals))])):
        expected = signal_of(logits, position, lambda t: token_kind(local.token_bytes(t)))
        assert signal == expected
        x = features(signal)
        assert x[FEATURES.index("entropy")] == signal.entropy and x[FEATURES.index("p3")] == signal.top[2]
        assert x[FEATURES.index("first")] == (position == 0)
    kinds = [s.kind for s in policy.signals[:len(decoding.answer_tokens)]]
    assert kinds == [token_kind(local.token_bytes(t)) for t in decoding.answer_tokens]
    assert {"word", "digit", "punct", "newline"} <= set(kinds)


def test_a_router_trained_on_a_synthetic_set_separates_it():
    router = train(synthetic(300, 0), [0.1, 0.2, 0.3], "sha-of-model", {})
    held_out = synthetic(200, 1)
    rows = {(r["method"], r["target_share"]): r for r in compare(router, held_out, [0.3])}
    learned, entropy = rows[("learned", 0.3)], rows[("entropy", 0.3)]
    assert learned["mismatch_recall"] > 0.9 > entropy["mismatch_recall"] + 0.2
    assert abs(learned["share"] - entropy["share"]) < 0.02  # compared at the same share
    assert router.threshold_for_share(0.1) > router.threshold_for_share(0.3)


def test_thresholds_refitted_on_other_answers_route_their_share_of_them():
    router = train(synthetic(300, 0), [0.1, 0.3], "sha-of-model", {"command": "train"})
    other = synthetic(200, 2)
    for record in other:  # another task: uniformly less certain text, so the old thresholds over-route
        record["entropy"] = [e + 1.0 for e in record["entropy"]]
    x, _, _ = matrix(other)
    scores = np.array([router.score(row) for row in x])
    assert (scores > router.threshold_for_share(0.1)).mean() > 0.15
    refitted = with_thresholds(router, matrix(other)[0], [0.1, 0.3], {"thresholds": {"dataset": "other"}})
    for share in (0.1, 0.3):
        assert (scores > refitted.threshold_for_share(share)).mean() == pytest.approx(share, abs=0.01)
    assert np.array_equal(refitted.weights, router.weights)
    assert refitted.meta == {"command": "train", "thresholds": {"dataset": "other"}}


def test_a_threshold_taken_from_traffic_holds_the_share_where_the_fitted_one_does_not():
    router = train(synthetic(300, 0), [0.1, 0.3], "sha", {})
    other = synthetic(200, 2)
    for record in other:  # another task: less certain text, where the fitted threshold over-routes
        record["entropy"] = [e + 1.0 for e in record["entropy"]]
    windows, routed = SharedWindows(), {"router": [], "traffic": []}
    for record in other:  # a fresh policy per answer, as the gateway builds one per request
        policies = {source: build_policy("learned", target_fraction=0.1, router=router, windows=windows,
                                         threshold_from=source) for source in routed}
        for step in steps([record]):
            for source, policy in policies.items():
                routed[source].append(policy.decide(step_signal(step), RoutingState()).upstream)
    assert np.mean(routed["router"]) > 0.15
    assert np.mean(routed["traffic"]) == pytest.approx(0.1, abs=0.01)
    fitted = routed["router"]
    # until the window holds enough scores the fitted threshold decides; then only the quantile moves
    assert routed["traffic"][:31] == fitted[:31]
    scores = np.array([router.score(row) for row in matrix(other)[0]])
    assert scores[np.array(routed["traffic"])].min() > np.quantile(scores, 0.8)


@pytest.mark.parametrize("draw", ["normal", "repeated"])
def test_recent_values_keep_the_quantiles_of_the_newest_values(draw):
    rng = np.random.default_rng(5)
    values = rng.normal(size=300) if draw == "normal" else rng.integers(0, 5, size=300).astype(float)
    window = RecentValues(size=50)
    for count, value in enumerate(values, 1):
        window.add(float(value))
        newest = values[max(0, count - 50):count]
        assert len(window) == len(newest)
        for q in (0.0, 0.37, 0.9, 1.0):
            assert window.quantile(q) == pytest.approx(np.quantile(newest, q))
        for over in (-9.0, 0.0, 1.0, 4.0):
            above = newest[newest > over]
            assert window.mean_excess(over) == (pytest.approx(above.mean() - over) if above.size else None)


def test_threshold_from_traffic_is_asked_with_a_share_of_a_learned_policy():
    alias = RoutingSettings(policy="learned", threshold=0.4, router="router.json")
    asked = resolve_routing(alias, RoutingOverride(target_fraction=0.1, threshold_from="traffic"))
    assert (asked.threshold, asked.target_fraction, asked.threshold_from) == (None, 0.1, "traffic")
    tenant = RoutingOverride(target_fraction=0.05, threshold_from="traffic")
    assert resolve_routing(alias, tenant, RoutingOverride(target_fraction=0.2)).threshold_from == "traffic"
    for request in (RoutingOverride(threshold_from="traffic"),  # the alias's score threshold stands
                    RoutingOverride(policy="entropy", threshold=1.0, threshold_from="traffic")):
        with pytest.raises(InvalidRequest) as refused:
            resolve_routing(alias, request)
        assert refused.value.param == "routing.threshold_from"
    with pytest.raises(ValueError, match="threshold_from"):
        build_policy("learned", target_fraction=0.1, router=train(synthetic(50, 0), [0.2], "sha", {}),
                     threshold_from="fit rows")


def test_thresholds_command_refits_a_router_file_on_the_local_answers_of_its_rows(tmp_path, capsys):
    source, out = tmp_path / "router.json", tmp_path / "refitted.json"
    source.write_text(json.dumps(train(synthetic(100, 0), [0.1], "sha", {"command": "train"}).to_json()))
    analysis = tmp_path / "runs" / "r" / "analysis" / "gsm8k.local.jsonl"
    analysis.parent.mkdir(parents=True)
    answers = [{**record, "id": f"gsm8k-{row}", "row": row} for row, record in enumerate(synthetic(60, 3))]
    analysis.write_text("".join(json.dumps(record) + "\n" for record in answers))
    command = ["thresholds", "--dataset", "gsm8k", "--run-name", "r", "--runs-dir", str(tmp_path / "runs"),
               "--router", str(source), "--share", "0.2", "--out", str(out)]

    assert eval_main([*command, "--fit-rows", "0:40"]) == 0
    refitted = Router.load(out, "sha")
    x, _, _ = matrix(answers[:40])
    routed = np.array([refitted.score(row) for row in x]) > refitted.threshold_for_share(0.2)
    assert routed.mean() == pytest.approx(0.2, abs=0.01)
    assert refitted.meta["command"] == "train"
    assert refitted.meta["thresholds"]["fit_rows"] == "0:40" and refitted.meta["thresholds"]["fit_answers"] == 40
    assert eval_main([*command, "--fit-rows", "100:200"]) == 2
    assert "analyze --answers local" in capsys.readouterr().err
    analysis.write_text("".join(json.dumps({**record, "model_sha256": "other"}) + "\n" for record in answers))
    assert eval_main([*command, "--fit-rows", "0:40"]) == 2
    assert "trained for another local model" in capsys.readouterr().err


def test_a_router_file_trained_for_another_model_is_refused(tmp_path):
    router = train(synthetic(50, 0), [0.2], "sha-of-model", {"command": "test"})
    path = tmp_path / "router.json"
    path.write_text(json.dumps(router.to_json()))
    loaded = Router.load(path, "sha-of-model")
    x = features(signal_of(np.array([3.0, 1.0, 0.5, 0.0, -1.0]), 2))
    assert loaded.score(x) == pytest.approx(router.score(x)) and loaded.meta["command"] == "test"
    with pytest.raises(RouterError, match="trained for the local model with sha256 sha-of-model"):
        Router.load(path, "sha-of-another-model")
    path.write_text("{}")
    with pytest.raises(RouterError, match="not a router file"):
        Router.load(path)


def test_learned_policy_routes_above_its_threshold_and_needs_a_router():
    router = train(synthetic(100, 0), [0.2], "sha", {})
    policy = build_policy("learned", target_fraction=0.2, router=router)
    scores = [router.score(features(signal_of(np.array([v, 0.0, 0.0, 0.0]), 1))) for v in (0.0, 8.0)]
    decisions = [policy.decide(signal_of(np.array([v, 0.0, 0.0, 0.0]), 1), RoutingState()) for v in (0.0, 8.0)]
    threshold = router.threshold_for_share(0.2)
    assert decisions == [UPSTREAM if s > threshold else LOCAL for s in scores]
    alias = RoutingSettings(policy="entropy", threshold=2.0)
    with pytest.raises(InvalidRequest) as refused:
        resolve_routing(alias, RoutingOverride(policy="learned", target_fraction=0.1))
    assert refused.value.param == "routing.policy"
    with_router = RoutingSettings(policy="entropy", threshold=2.0, router="router.json")
    assert resolve_routing(with_router, RoutingOverride(policy="learned", target_fraction=0.1)).policy == "learned"
    first = resolve_routing(alias, RoutingOverride(policy="first", threshold=2))
    assert build_policy(first.policy, first.threshold).decide(signal_of(np.zeros(3), 1), RoutingState()).upstream
    with pytest.raises(InvalidRequest):
        resolve_routing(alias, RoutingOverride(policy="first", threshold=1.5))


async def test_divergent_marks_only_the_mismatch_that_changes_the_prediction():
    from fitting.datasets import Item
    from eval.divergence import divergent

    local = FakeLocalModel(["A", "B", ".", " library", " is", " nice"], "B. library is nice")
    item = Item("q", [{"role": "user", "content": "q"}], "B", {"choices": {"A": "park", "B": "library"}})
    reference = local.tokenize_text(b"A. library is nice")  # the upstream's answer
    # The local model wants "B" first and, once off its own track, ends the answer at once.
    labels = await divergent(local, "csqa", item, reference, "11000", max_tokens=8)
    assert labels == "10000"  # "B" instead of "A" changes the answer; ending after "A" does not
