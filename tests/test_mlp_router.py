"""The MLP router: trained in numpy, served from its file, refused for another model, fed the hidden state."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from adapters.memory_store import MemoryStore
from adapters.store import Limits
from fitting.analysis import auroc
from eval.learn_mlp import SCALARS, fit_mlp, forward, projection, reduce, train_mlp
from gateway.decoding.decoder import DecodeRequest, Decoding
from gateway.decoding.values import RequestRouting
from gateway.decoding.signals import signal_of
from gateway.tenancy.budget import HandoffGate, Ledger
from policies import LOCAL, RoutingState, build_policy
from policies.base import PolicyDefaults
from policies.learned import FEATURES, Router, RouterError, features
from policies.mlp_router import MlpRouter
from tests.fakes import FakeLocalModel

HIDDEN = 16
FIT = {"units": 32, "epochs": 30, "learning_rate": 1e-2}
LOCAL_MODEL = "qwen2.5-coder-0.5b-instruct"
ROUTERS = Path(__file__).resolve().parent.parent / "routers"


def synthetic_steps(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Rows (FEATURES of random signals, then a hidden state) whose label is an XOR of two hidden
    directions: no linear model separates it, one hidden layer does."""
    rng = np.random.default_rng(seed)
    signals = [signal_of(rng.normal(0, 2, 8), int(rng.integers(0, 50)), lambda t: "word",
                         rng.normal(0, 1, HIDDEN).astype(np.float32)) for _ in range(n)]
    x = np.array([np.concatenate([features(s), s.hidden]) for s in signals])
    y = ((x[:, len(FEATURES)] > 0) ^ (x[:, len(FEATURES) + 1] > 0)).astype(float)
    return x, y, signals


@pytest.fixture(scope="module")
def trained() -> tuple[MlpRouter, np.ndarray, np.ndarray, list]:
    x, y, signals = synthetic_steps(1500, 0)
    router = train_mlp(x, y, [0.1, 0.5], "sha-of-model", {"command": "test"}, **FIT)
    return router, x, y, signals


def test_the_served_router_scores_each_step_as_training_computed_it(trained):
    router, x, _, signals = trained
    params = fit_mlp(x, synthetic_steps(1500, 0)[1], **FIT)  # deterministic: the same fit
    assert np.array_equal(params.w1, router.w1) and params.b2 == router.b2
    served = np.array([router.score_signal(signal) for signal in signals])
    assert np.allclose(served, forward(params, x), rtol=1e-9, atol=1e-12)
    assert router.reads_hidden and router.hidden_size == HIDDEN


def test_it_learns_what_the_hidden_state_says_and_a_line_cannot(trained):
    router, *_ = trained
    x, y, signals = synthetic_steps(600, 1)
    assert auroc([router.score_signal(s) for s in signals], y.astype(bool)) > 0.9
    share = np.mean([router.score(row) > router.threshold_for_share(0.5) for row in x])
    assert share == pytest.approx(0.5, abs=0.08)  # thresholds fitted on the training rows hold on new ones


def test_a_router_file_round_trips_and_another_models_is_refused(trained, tmp_path):
    router, x, _, _ = trained
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(router.to_json()))
    loaded = Router.load(path, "sha-of-model")
    assert isinstance(loaded, MlpRouter) and loaded.meta == {"command": "test"}
    assert loaded.shares == router.shares and np.array_equal(loaded.w1, router.w1)
    assert [loaded.score(row) for row in x[:50]] == [router.score(row) for row in x[:50]]
    with pytest.raises(RouterError, match="trained for the local model with sha256 sha-of-model"):
        Router.load(path, "sha-of-another-model")
    broken = router.to_json()
    broken["hidden_size"] = HIDDEN + 1
    path.write_text(json.dumps(broken))
    with pytest.raises(RouterError, match="not a usable mlp router"):
        Router.load(path)
    path.write_text(json.dumps({**router.to_json(), "kind": "forest"}))
    with pytest.raises(RouterError, match="kind 'forest'"):
        Router.load(path)


def test_logistic_router_files_load_as_before():
    for path in ROUTERS.glob("*.json"):
        data = json.loads(path.read_text())
        if data["format"].startswith("routing-gateway/learned-router") and data.get("kind", "logistic") == "logistic":
            router = Router.load(path)
            assert isinstance(router, Router) and not router.reads_hidden


def test_the_shipped_mlp_router_loads_for_its_model_and_scores_a_step():
    path = ROUTERS / "gsm8k-mlp-qwen2.5-coder-0.5b.json"
    router = Router.load(path, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
    assert isinstance(router, MlpRouter) and router.hidden_size == 896 and router.reads_hidden
    assert "eval.hidden_router" in router.meta["command"]
    hidden = np.random.default_rng(0).normal(0, 1, 896).astype(np.float32)
    assert 0.0 <= router.score_signal(signal_of(np.zeros(4), 3, lambda t: "word", hidden)) <= 1.0


class Watching(PolicyDefaults):
    """A policy that reads the hidden state: it keeps what each step's signal carried, routes nothing."""

    name, reads_hidden = "watching", True

    def __init__(self) -> None:
        self.hidden = []

    def decide(self, signal, state):
        self.hidden.append(signal.hidden)
        return LOCAL


async def decode(policy) -> FakeLocalModel:
    local = FakeLocalModel(["Paris", " is", " nice", "."], "Paris is nice.")
    request = DecodeRequest(messages=[{"role": "user", "content": "q"}], max_tokens=8, routing=RequestRouting(policy))
    decoding = Decoding(local, None, HandoffGate(Ledger(MemoryStore()), "t", Limits(), allowed=True), request)
    [piece async for piece in decoding.pieces()]
    return local


async def test_the_decoder_asks_for_the_hidden_state_only_for_a_policy_that_reads_it(trained):
    watching = Watching()
    local = await decode(watching)
    assert local.wants_hidden and len(watching.hidden) == len(local.forwards) == 5
    for hidden, tokens in zip(watching.hidden, local.forwards):  # the fake's hidden state is its logits
        assert np.array_equal(hidden, await local.forward(tokens))
    assert not (await decode(build_policy("entropy", 2.0))).wants_hidden

    router, *_ = trained
    assert build_policy("learned", target_fraction=0.1, router=router).reads_hidden  # through its caps
    logistic = Router.load(ROUTERS / "gsm8k-qwen2.5-coder-0.5b.json")
    assert not build_policy("learned", target_fraction=0.1, router=logistic).reads_hidden
    with pytest.raises(ValueError, match="hidden state"):
        build_policy("learned", target_fraction=0.1, router=router).decide(
            signal_of(np.zeros(4), 0, lambda t: "word"), RoutingState())


def test_the_comparison_fits_on_train_rows_reports_on_dev_rows_and_writes_a_router(tmp_path):
    from eval.studies.hidden_state.hidden_router import main as compare_main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(40)))
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    for run, rows, seed in (("train", range(30), 0), ("dev", range(10), 1)):
        (runs / run).mkdir(parents=True)
        (runs / run / "gsm8k__upstream.jsonl").write_text(
            "".join(json.dumps({"id": f"gsm8k-{i}", "tokens": [1, 2]}) + "\n" for i in rows))
        (cache / run).mkdir(parents=True)
        for i in rows:  # the teacher-forced rows, as if made before: no model is loaded
            x, y, _ = synthetic_steps(150, seed * 1000 + i)
            np.savez(cache / run / f"gsm8k-gsm8k-{i}.npz", x=x.astype(np.float32), y=y)
    out = tmp_path / "mlp.json"
    assert compare_main(["--train-run", "train", "--train-data", str(data), "--dev-run", "dev", "--dev-rows", "0:10",
                         "--runs-dir", str(runs), "--cache", str(cache), "--out-router", str(out),
                         "--share", "0.1", "0.5",
                         "--baseline-router", str(ROUTERS / "gsm8k-qwen2.5-coder-0.5b.json")]) == 0
    report = json.loads((runs / "train" / "hidden_router_gsm8k_dev0-10.json").read_text())
    assert report["train"]["answers"] == 30 and report["dev"]["positions"] == 1500
    found = report["dev_auroc"]
    assert found["mlp (scalars + hidden)"] > 0.85 > found["logistic (scalars)"] + 0.2  # the XOR is in the hidden state
    assert 0 <= found["logistic gsm8k-qwen2.5-coder-0.5b.json"] <= 1
    gain = report["mlp (scalars + hidden) dev_auroc_gain"]["over logistic (scalars)"]
    assert gain["low"] > 0.1 and gain["low"] <= gain["gain"] <= gain["high"]  # bootstrapped over dev answers
    router = Router.load(out, report["local_model_sha256"])
    assert isinstance(router, MlpRouter) and router.meta["fit"]["answers"] == 30 and set(router.shares) == {0.1, 0.5}


def test_divergent_labels_are_rated_on_halves_of_the_labelled_train_answers(tmp_path):
    from eval.studies.hidden_state.hidden_router import main as compare_main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(30)))
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    (runs / "train" / "analysis").mkdir(parents=True)
    (runs / "train" / "gsm8k__upstream.jsonl").write_text(
        "".join(json.dumps({"id": f"gsm8k-{i}", "tokens": [1, 2]}) + "\n" for i in range(30)))
    (cache / "train").mkdir(parents=True)
    labels = []
    for i in range(30):
        x, mismatch, _ = synthetic_steps(150, 100 + i)
        np.savez(cache / "train" / f"gsm8k-gsm8k-{i}.npz", x=x.astype(np.float32), y=mismatch)
        divergent = mismatch * (x[:, len(FEATURES) + 2] > 0)  # which mismatches diverge: only the hidden state says
        if i < 20:  # ten answers are not labelled yet
            labels.append({"id": f"gsm8k-{i}", "row": i, "divergent": "".join(str(int(v)) for v in divergent)})
    (runs / "train" / "analysis" / "gsm8k.divergent.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labels))
    out = tmp_path / "mlp.json"
    assert compare_main(["--label", "divergent", "--train-run", "train", "--train-data", str(data),
                         "--runs-dir", str(runs), "--cache", str(cache), "--out-router", str(out),
                         "--share", "0.1"]) == 0
    report = json.loads((runs / "train" / "hidden_router_gsm8k_divergent_halves.json").read_text())
    assert report["train"]["answers"] == 20 and report["train"]["positions"] == 3000
    for half in ("even rows", "odd rows"):
        rated = report["halves"][half]
        assert rated["answers"] == 10 and rated["positions"] == 1500
        among = rated["auroc among mismatches"]
        assert among["mlp (scalars + hidden)"] > 0.8 and abs(among["1-top1"] - 0.5) < 0.15
    router = Router.load(out, report["local_model_sha256"])
    assert router.meta["labels"].startswith("divergent") and router.meta["fit"]["answers"] == 20

    (runs / "train" / "analysis" / "gsm8k.divergent.jsonl").write_text(
        json.dumps({"id": "gsm8k-0", "row": 0, "divergent": "01"}) + "\n")
    with pytest.raises(ValueError, match="2 divergent labels for 150 positions"):
        compare_main(["--label", "divergent", "--train-run", "train", "--train-data", str(data),
                      "--runs-dir", str(runs), "--cache", str(cache)])


def test_an_mlp_routers_thresholds_are_refitted_on_the_local_models_own_answers(trained, tmp_path, monkeypatch):
    import eval.hidden_steps
    from adapters.model_files import model_sha256
    from eval.__main__ import main as eval_main

    router, *_ = trained
    source = tmp_path / "mlp.json"
    source.write_text(json.dumps(dataclasses.replace(router, model_sha256=model_sha256(LOCAL_MODEL)).to_json()))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(6)))
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    (runs / "r").mkdir(parents=True)
    (runs / "r" / "gsm8k__local.jsonl").write_text(
        "".join(json.dumps({"id": f"gsm8k-{i}", "tokens": [1, 2]}) + "\n" for i in range(6)))
    (cache / "r").mkdir(parents=True)
    live = []
    for i in range(6):  # the local answers, teacher-forced before: no model is loaded
        x, y, _ = synthetic_steps(100, 50 + i)
        x[:, len(FEATURES)] += 1.0  # the live distribution differs from the training rows'
        np.savez(cache / "r" / f"gsm8k-local-gsm8k-{i}.npz", x=x.astype(np.float32), y=y)
        live.append(x)
    monkeypatch.setattr(eval.hidden_steps, "CACHE_DIR", cache)
    out = tmp_path / "refitted.json"
    assert eval_main(["thresholds", "--dataset", "gsm8k", "--run-name", "r", "--runs-dir", str(runs),
                      "--router", str(source), "--share", "0.2", "--out", str(out), "--data", str(data),
                      "--fit-rows", "0:4"]) == 0
    refitted = Router.load(out)
    fitted_on = np.vstack(live[:4])
    assert np.mean([refitted.score(row) > refitted.threshold_for_share(0.2) for row in fitted_on]) \
        == pytest.approx(0.2, abs=0.01)
    assert refitted.meta["thresholds"]["fit_answers"] == 4 and np.array_equal(refitted.w1, router.w1)


def test_a_hidden_state_projected_for_training_folds_into_the_router_file():
    x, y, signals = synthetic_steps(800, 3)
    basis = projection(x[:, SCALARS:], 4)
    params = fit_mlp(reduce(x, basis), y, **FIT)  # what training computes, on 12 + 4 inputs
    router = train_mlp(x, y, [0.5], "sha", {}, pca=4, **FIT)
    assert router.w1.shape == (FIT["units"], len(FEATURES) + HIDDEN)  # served on the raw hidden state
    served = np.array([router.score_signal(signal) for signal in signals])
    assert np.allclose(served, forward(params, reduce(x, basis)), rtol=1e-7, atol=1e-10)
