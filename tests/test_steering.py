"""Steering: vector files, fitting and read-out maths, and control vectors on the real llama.cpp engine.

The engine tests compare a steered engine with a plain one over the same GGUF (SmolLM2, one
sequence each, the same batch shapes), so logits that should not move must be bitwise equal.
The "direction" test uses the last layer: its output at the last token feeds only the final norm
and the output layer, so adding (B's state - A's state) there turns A's logits into B's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from adapters.local_model import LocalModel, LocalModelError
from adapters.model_files import model_sha256
from adapters.steering import Steering, SteeringError, SteeringVector
from bench.support import ROOT, SMOL, gateway_config, live_gateway, prompt
from gateway.config_checks import steering_of
from gateway.settings import SettingsError, load_settings
from fitting.steering.fit import directions
from fitting.steering.probe import held_out_accuracy, transfer_accuracy

# -- files and maths (no model) --


def test_a_vector_file_round_trips_and_names_its_model(tmp_path):
    rows = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    SteeringVector(rows, "ab" * 32, {"local_model": "m", "method": "mean"}).save(tmp_path / "v.npz")
    loaded = SteeringVector.load(tmp_path / "v.npz", "ab" * 32)
    assert np.array_equal(loaded.directions, rows) and loaded.meta["local_model"] == "m"
    with pytest.raises(SteeringError, match="fitted for the model with sha256 abab.* not cdcd"):
        SteeringVector.load(tmp_path / "v.npz", "cd" * 32)
    (tmp_path / "bad.npz").write_bytes(b"not a file")
    with pytest.raises(SteeringError, match="not a steering vector file"):
        SteeringVector.load(tmp_path / "bad.npz")


def test_control_rows_start_at_layer_one_and_refuse_another_shape():
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    steering = Steering(SteeringVector(rows, "x"), 2.0, (1, 3))
    assert np.array_equal(steering.control(4, 3), rows[1:] * 2)
    with pytest.raises(SteeringError, match="width 3; the model has 4 of width 5"):
        steering.control(4, 5)
    with pytest.raises(SteeringError, match="outside the model's layers 1..3"):
        Steering(SteeringVector(rows, "x"), 1.0, (2, 4)).control(4, 3)


def test_mean_and_pca_directions_point_along_the_contrast():
    rng = np.random.default_rng(1)
    concept = np.zeros(16)
    concept[3] = 1.0
    negative = rng.normal(size=(40, 2, 16))
    positive = negative + 2.0 * concept + 0.3 * rng.normal(size=(40, 2, 16))
    mean, pca = directions(positive, negative, "mean"), directions(positive, negative, "pca")
    for rows in (mean, pca):
        assert rows.shape == (2, 16)
        assert np.all(rows[:, 3] > 1.8) and np.all(np.abs(np.delete(rows, 3, axis=1)) < 0.2)
    # sized to the mean along it
    assert np.allclose(np.linalg.norm(pca, axis=1), np.abs(pca @ concept / 1.0), rtol=0.05)
    flipped = directions(negative, positive, "pca")
    assert np.all(flipped[:, 3] < -1.8)  # the sign follows the mean, whatever the SVD returned


def test_the_probe_separates_a_linear_contrast_and_not_noise():
    rng = np.random.default_rng(2)
    shift = rng.normal(size=50)
    shift *= 4.0 / np.linalg.norm(shift)  # Bayes accuracy 0.98
    negative, positive = rng.normal(size=(60, 50)), rng.normal(size=(60, 50))
    assert held_out_accuracy(positive + shift, negative) >= 0.9
    assert 0.3 <= held_out_accuracy(positive, negative) <= 0.7


def test_a_probe_transfers_where_two_sets_share_the_contrast_and_not_where_they_do_not():
    rng = np.random.default_rng(3)
    shared, own = np.zeros(50), np.zeros(50)
    shared[0], own[1] = 4.0, 4.0
    a_negative, b_negative = rng.normal(size=(60, 50)), rng.normal(size=(60, 50)) + 3.0  # b: another task's offset
    a_positive = rng.normal(size=(60, 50)) + shared
    assert transfer_accuracy(a_positive, a_negative, rng.normal(size=(60, 50)) + 3.0 + shared, b_negative) >= 0.9
    assert 0.3 <= transfer_accuracy(a_positive, a_negative, rng.normal(size=(60, 50)) + 3.0 + own, b_negative) <= 0.7


@pytest.mark.parametrize("layers", [[0, 3], [5, 3]])
def test_settings_refuse_steering_layers_out_of_order(tmp_path, layers):
    config = gateway_config(None)
    config["models"]["local"]["smol"]["steering"] = {"vector": "v.npz", "scale": 1.0, "layers": layers}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SettingsError, match="models.local.smol.steering.layers"):
        load_settings(path)



def _synthetic_report(concepts: int):
    from fitting.steering.report import Readout, Report

    rng = np.random.default_rng(4)
    readouts = []
    for index in range(concepts):
        positive, negative = rng.normal(size=(6, 3, 8)), rng.normal(size=(6, 3, 8))
        direction = directions(positive, negative, "mean")
        readouts.append(Readout(f"c{index}", [0.5, 0.75, 1.0], direction, positive, negative))
    return Report.of(readouts)


def test_a_report_writes_its_json_and_its_heatmap_only_when_asked(tmp_path):
    from fitting.steering.report import write

    report = _synthetic_report(2)
    assert write(report, tmp_path / "plain", {"command": "x"}, heatmap=False) == [tmp_path / "plain" / "report.json"]
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["report.json"]
    saved = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert saved["probe_accuracy"]["c0"] == [0.5, 0.75, 1.0]
    assert set(saved["transfer_accuracy"]) == {"c0 -> c1", "c1 -> c0"}
    pytest.importorskip("matplotlib")
    written = write(report, tmp_path / "full", {"command": "x"})
    assert written[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_steer_report_without_matplotlib_fails_in_one_line_before_loading_a_model(tmp_path, monkeypatch, capsys):
    import importlib.util

    from fitting.steering.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"positive": "a", "negative": "b"}\n' * 2)
    args = ["steer", "report", "--model", str(tmp_path / "absent.gguf"), "--pairs", str(pairs),
            "--out", str(tmp_path / "r")]
    assert main(args) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "needs matplotlib" in error
    assert "pip install 'routing-gateway[fitting]'" in error and "--no-heatmap" in error
    assert main([*args, "--no-heatmap"]) == 2  # past the check, the model is looked for: absent
    assert "absent.gguf" in capsys.readouterr().err


# -- the real engine --

TEXT_A = ("You are a helpful assistant.", "What is the capital of France?")
TEXT_B = ("You are a helpful assistant.", "Say hello in Spanish.")  # its answer starts otherwise


async def _load(path, steering: Steering | None = None) -> LocalModel:
    # flash attention off, as in the capture context: its kernel rounds the states differently
    return await LocalModel.load(path, n_ctx=512, n_threads=1, n_batch=256, queue_limit=4, parallel=1,
                                 look_ahead=False, flash_attn=False, steering=steering)


async def _greedy_logits(local: LocalModel, tokens: list[int], steps: int = 4) -> list[np.ndarray]:
    out, seen = [], []
    async with local.sequence(tokens) as sequence:
        for _ in range(steps):
            logits = await sequence.forward(tokens + out)
            seen.append(logits)
            out.append(int(np.argmax(logits)))
    return seen


@pytest.fixture(scope="module")
def smol_shape(smol_path):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(smol_path), n_ctx=64, verbose=False)
    shape = llama_cpp.llama_model_n_layer(llm._model.model), llama_cpp.llama_model_n_embd(llm._model.model)
    llm.close()
    return shape


@pytest.fixture(scope="module")
def last_states(smol_path):
    """The last token's per-layer states and final-norm output for prompts A and B (capture context)."""
    from fitting.steering.fit import open_model

    with open_model(SMOL) as model:
        tokens = {name: prompt_tokens(model, *text) for name, text in (("a", TEXT_A), ("b", TEXT_B))}
        yield {name: (tokens[name], *model.capture.states(tokens[name])) for name in tokens}


def prompt_tokens(model, system: str, user: str) -> list[int]:
    from fitting.steering.prompts import prompt_tokens as render

    return render(model.capture, [{"role": "system", "content": system}, {"role": "user", "content": user}])


def vector(rows: np.ndarray) -> SteeringVector:
    return SteeringVector(rows.astype(np.float32), model_sha256(SMOL), {"local_model": SMOL})


@pytest.mark.integration
async def test_a_zero_vector_leaves_logits_bitwise_unchanged(smol_path, smol_shape):
    n_layer, n_embd = smol_shape
    plain = await _load(smol_path)
    zero = await _load(smol_path, Steering(vector(np.zeros((n_layer, n_embd))), 1.0, (1, n_layer - 1)))
    try:
        tokens = prompt(plain, *TEXT_A)
        for a, b in zip(await _greedy_logits(plain, tokens), await _greedy_logits(zero, tokens)):
            assert np.array_equal(a, b)
    finally:
        plain.close()
        zero.close()


@pytest.mark.integration
async def test_a_vector_acts_only_on_its_layers(smol_path, smol_shape):
    n_layer, n_embd = smol_shape
    rows = np.zeros((n_layer, n_embd))
    rows[1:6] = np.random.default_rng(3).normal(size=(5, n_embd)) * 4.0  # strong, on layers 1-5 only
    plain = await _load(smol_path)
    outside = await _load(smol_path, Steering(vector(rows), 1.0, (6, n_layer - 1)))
    inside = await _load(smol_path, Steering(vector(rows), 1.0, (5, 5)))
    try:
        tokens = prompt(plain, *TEXT_A)
        reference = await _greedy_logits(plain, tokens, 2)
        for a, b in zip(reference, await _greedy_logits(outside, tokens, 2)):
            assert np.array_equal(a, b)
        moved = (await _greedy_logits(inside, tokens, 1))[0]
        assert np.abs(moved - reference[0]).max() > 0.1
    finally:
        for local in (plain, outside, inside):
            local.close()


@pytest.mark.integration
async def test_a_vector_on_the_last_layer_moves_logits_to_its_target(smol_path, smol_shape, last_states):
    n_layer, n_embd = smol_shape
    tokens_a, layers_a, _ = last_states["a"]
    tokens_b, layers_b, _ = last_states["b"]
    rows = np.zeros((n_layer, n_embd))
    rows[n_layer - 1] = layers_b[-1] - layers_a[-1]
    plain = await _load(smol_path)
    try:
        logits_a = (await _greedy_logits(plain, tokens_a, 1))[0]
        logits_b = (await _greedy_logits(plain, tokens_b, 1))[0]
    finally:
        plain.close()
    assert np.argmax(logits_a) != np.argmax(logits_b)
    # The states were captured in another context (other batch shapes): ~2% rounding apart, which
    # leaves scale 1 a few percent short of B's logits (measured 0.05), not bitwise on them.
    for scale, (low, high) in ((1.0, (0.0, 0.15)), (0.5, (0.3, 0.7))):
        steered = await _load(smol_path, Steering(vector(rows), scale, (n_layer - 1, n_layer - 1)))
        try:
            logits = (await _greedy_logits(steered, tokens_a, 1))[0]
        finally:
            steered.close()
        distance = np.linalg.norm(logits - logits_b) / np.linalg.norm(logits_a - logits_b)
        assert low <= distance < high
        assert logits[np.argmax(logits_b)] > logits_a[np.argmax(logits_b)]  # B's token gains
        if scale == 1.0:
            assert np.argmax(logits) == np.argmax(logits_b)  # A, steered, answers B's first token


@pytest.mark.integration
async def test_captured_states_are_the_engines_final_hidden_state_and_layer_outputs(smol_path, last_states):
    local = await LocalModel.load(smol_path, n_ctx=512, n_threads=1, n_batch=256, queue_limit=4, parallel=1)
    try:
        for tokens, _, final in last_states.values():
            async with local.sequence(tokens, hidden=True) as sequence:
                await sequence.forward(tokens)
                hidden = sequence.hidden
            assert np.linalg.norm(final - hidden) / np.linalg.norm(hidden) < 0.05  # tests/test_hidden_state.py's bound
    finally:
        local.close()
    # final = RMSNorm(last layer's output) * the output norm's weights: the same weights for both prompts
    weights = []
    for _, layers, final in last_states.values():
        last = layers[-1].astype(np.float64)
        weights.append(final / (last / np.sqrt(np.mean(last ** 2) + 1e-5)))
    assert np.allclose(weights[0], weights[1], rtol=1e-3, atol=1e-4)
    assert not np.allclose(last_states["a"][1][-2], last_states["b"][1][-2], rtol=0.1)  # two prompts, two states


@pytest.mark.integration
def test_a_prompt_split_across_batches_captures_its_last_token(monkeypatch, last_states):
    import adapters.hidden_states as capture
    from fitting.steering.fit import open_model

    tokens, layers, final = last_states["a"]
    monkeypatch.setattr(capture, "UBATCH", 8)  # the prompt in several graphs
    with open_model(SMOL) as model:
        split_layers, split_final = model.capture.states(tokens)
        other = model.capture.states(last_states["b"][0])[0]
    assert len(tokens) > 16
    for got, want in ((split_layers[1:], layers[1:]), (split_final, final)):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
    assert np.linalg.norm(other[-1] - layers[-1]) / np.linalg.norm(layers[-1]) > 0.1  # another prompt is far


@pytest.mark.integration
async def test_wrong_vectors_are_refused(tmp_path, smol_path, smol_shape):
    n_layer, n_embd = smol_shape
    narrow = Steering(vector(np.zeros((n_layer, n_embd - 1))), 1.0, (1, 2))
    with pytest.raises(LocalModelError, match=f"width {n_embd - 1}; the model has {n_layer} of width {n_embd}"):
        await _load(smol_path, narrow)
    other = SteeringVector(np.zeros((n_layer, n_embd), np.float32), model_sha256("qwen2.5-coder-0.5b-instruct"),
                           {"local_model": "qwen2.5-coder-0.5b-instruct"})
    other.save(tmp_path / "qwen.npz")
    config = gateway_config(None)
    config["models"]["local"]["steered"] = {"gguf": SMOL, "n_threads": 1,
                                            "steering": {"vector": str(tmp_path / "qwen.npz"), "scale": 1.0,
                                                         "layers": [1, 2]}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TEST_DEMO_KEY": "sk-x", "TEST_ADMIN_KEY": "sk-y"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: models.local.steered.steering: ") and "(qwen2.5-coder-0.5b-instruct)" in result.stderr
    vector(np.zeros((n_layer, n_embd))).save(tmp_path / "smol.npz")  # the right model, layers it lacks
    config["models"]["local"]["steered"]["steering"].update(vector=str(tmp_path / "smol.npz"), layers=[1, n_layer])
    path.write_text(yaml.safe_dump(config))
    outside = rf"models.local.steered.steering: .*outside the model's layers 1..{n_layer - 1}"
    with pytest.raises(SettingsError, match=outside):
        steering_of(load_settings(path))


@pytest.mark.integration
def test_steered_and_plain_entries_decode_side_by_side_in_one_gateway(tmp_path, smol_shape, last_states):
    n_layer, n_embd = smol_shape
    rows = np.zeros((n_layer, n_embd))
    rows[n_layer - 1] = last_states["b"][1][-1] - last_states["a"][1][-1]
    vector(rows).save(tmp_path / "a-to-b.npz")
    config = gateway_config(None)
    config["models"]["local"]["smol"]["parallel"] = 1
    config["models"]["local"]["steered"] = {"gguf": SMOL, "n_ctx": 2048, "n_threads": 1, "parallel": 1, "steering": {
        "vector": str(tmp_path / "a-to-b.npz"), "scale": 1.0, "layers": [n_layer - 1, n_layer - 1]}}
    config["aliases"]["steered"] = {"local": "steered", "routing": {"policy": "never"}}
    with live_gateway(config, tmp_path) as gateway:
        client = gateway.client()

        def ask(alias: str) -> str:
            messages = [{"role": "system", "content": TEXT_A[0]}, {"role": "user", "content": TEXT_A[1]}]
            answer = client.chat.completions.create(model=alias, messages=messages, max_tokens=8, temperature=0)
            assert answer.model == alias and answer.usage.model_extra["routing"]["upstream_tokens"] == 0
            return answer.choices[0].message.content

        async def together() -> list[str]:
            return await asyncio.gather(*(asyncio.to_thread(ask, alias) for alias in ("local", "steered", "local")))

        alone = ask("local")
        plain, steered, plain_again = asyncio.run(together())
    assert plain == alone == plain_again  # the steered engine beside it changes nothing in the plain one
    assert steered and steered != plain


QUESTIONS = ["What is the capital of France?", "Name a yellow fruit.", "How many days are in a week?",
             "What colour is the sky?", "Who wrote Hamlet?", "What do bees make?"]


@pytest.mark.integration
async def test_steer_fit_and_report_commands(tmp_path, smol_path, smol_shape):
    from fitting.steering.cli import main

    n_layer, n_embd = smol_shape
    pairs = tmp_path / "french.jsonl"
    pairs.write_text("".join(json.dumps({"positive": f"Answer in French. {q}", "negative": f"Answer in English. {q}"})
                             + "\n" for q in QUESTIONS))
    for method in ("mean", "pca"):
        assert await asyncio.to_thread(main, ["steer", "fit", "--model", SMOL, "--pairs", str(pairs), "--method",
                                              method, "--out", str(tmp_path / f"{method}.npz")]) == 0
        fitted = SteeringVector.load(tmp_path / f"{method}.npz", model_sha256(SMOL))
        assert fitted.directions.shape == (n_layer, n_embd) and fitted.meta["method"] == method
        assert fitted.meta["concept"] == "french" and fitted.meta["pairs"] == len(QUESTIONS)
    mean, pca = (SteeringVector.load(tmp_path / f"{m}.npz").directions[-1] for m in ("mean", "pca"))
    assert float(mean @ pca) / (np.linalg.norm(mean) * np.linalg.norm(pca)) > 0.5  # one concept, signed alike
    # the mean vector on the last layer carries a negative prompt's logits toward its positive's
    plain = await _load(smol_path)

    def user(text: str) -> list[int]:  # rendered as `steer fit` renders a pair's side
        return plain.tokenize_prompt(plain.template.render_parts([{"role": "user", "content": text}]))

    steered = await _load(smol_path, Steering(SteeringVector.load(tmp_path / "mean.npz"), 1.0,
                                              (n_layer - 1, n_layer - 1)))
    try:
        moved = []
        for q in QUESTIONS[:3]:
            positive = (await _greedy_logits(plain, user(f"Answer in French. {q}"), 1))[0]
            negative = user(f"Answer in English. {q}")
            before = (await _greedy_logits(plain, negative, 1))[0]
            after = (await _greedy_logits(steered, negative, 1))[0]
            moved.append(np.linalg.norm(after - positive) / np.linalg.norm(before - positive))
    finally:
        plain.close()
        steered.close()
    assert max(moved) < 0.8, moved
    out = tmp_path / "report"
    assert await asyncio.to_thread(main, ["steer", "report", "--model", SMOL, "--pairs", str(pairs), str(pairs),
                                          "--folds", "5", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    accuracy = report["probe_accuracy"]["french"]
    assert len(accuracy) == n_layer and max(accuracy) >= 0.9
    assert report["cosine"]["same_layer"][1:] == pytest.approx([1.0] * (n_layer - 1), abs=1e-4)  # a concept with itself
    assert max(report["transfer_accuracy"]["french -> french"]) >= 0.9
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
