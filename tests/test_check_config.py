"""`python -m gateway check-config`: what start-up would refuse or warn of, without loading a model."""

from __future__ import annotations

import pytest
import yaml

from gateway.__main__ import main
from tests.conftest import ROOT, gateway_config, router_file


def check(config: dict, tmp_path, capsys) -> tuple[int, str, str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["check-config", "--config", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_shipped_config_passes(capsys):
    assert main(["check-config", "--config", str(ROOT / "config.yaml")]) == 0
    captured = capsys.readouterr()
    assert "config ok" in captured.out and "warning" not in captured.err


def test_an_alias_whose_routing_could_never_run_is_an_error(tmp_path, capsys):
    config = gateway_config("http://127.0.0.1:9/v1")
    for price in ("input_usd_per_mtok", "output_usd_per_mtok"):
        del config["upstreams"]["up"][price]  # an unknown model: no prices in litellm's map either
    config["aliases"]["routed"]["routing"].update(answer_value=1, escalation="draft")
    code, out, err = check(config, tmp_path, capsys)
    assert code == 2 and "config ok" not in out
    assert "error: aliases.routed: routing.escalation 'draft' needs an upstream with prices" in err


def test_a_tenant_override_that_refuses_requests_is_a_warning(tmp_path, capsys):
    config = gateway_config("http://127.0.0.1:9/v1")
    config["tenants"][0].update(routing={"escalation": "draft"}, aliases=["routed"])
    code, out, err = check(config, tmp_path, capsys)
    assert code == 0 and "config ok" in out
    assert ("warning: tenants.demo on alias routed: requests without routing of their own get a 400: "
            "routing.escalation 'draft' needs answer_value") in err


@pytest.mark.parametrize("sha, share, expected", [
    ("0" * 64, 0.1, "was trained for the local model with sha256 000"),
    (None, 0.5, "fitted for shares 0.1, 0.2: 0.5 is outside them"),
])
def test_a_router_the_gateway_cannot_use_is_an_error(tmp_path, capsys, sha, share, expected):
    config = gateway_config(None)
    config["aliases"]["learned"] = {"local": "smol", "routing": {"policy": "learned", "target_fraction": share,
                                                                 "router": router_file(tmp_path, sha=sha)}}
    code, _, err = check(config, tmp_path, capsys)
    assert code == 2 and expected in err


def test_a_missing_model_file_is_an_error(tmp_path, capsys):
    config = gateway_config(None)
    config["models"]["local"]["smol"]["gguf"] = str(tmp_path / "missing.gguf")
    code, _, err = check(config, tmp_path, capsys)
    assert code == 2 and "model file not found" in err


def commented_routings() -> list[str]:
    """Each `routing: {...}` example in the shipped config.yaml's comments, joined across its lines."""
    examples, current = [], None
    for line in (ROOT / "config.yaml").read_text().splitlines():
        text = line.strip()
        if not text.startswith("#"):
            current = None
            continue
        text = text.lstrip("#").strip()
        if current is None and text.startswith("routing: {"):
            current = text.removeprefix("routing: ")
        elif current is not None:
            current += " " + text
        if current is not None and current.endswith("}"):
            examples.append(current)
            current = None
    return examples


def test_the_shipped_config_comments_its_routing_examples():
    assert len(commented_routings()) >= 5  # the learned router, mixed traffic, two answer checks, prices


@pytest.mark.parametrize("example", commented_routings())
def test_each_routing_example_in_the_shipped_config_passes_for_the_reference_local_model(example, tmp_path, capsys):
    config = gateway_config("http://127.0.0.1:9/v1")
    config["models"]["local"]["qwen"] = {"gguf": "qwen2.5-coder-0.5b-instruct", "n_ctx": 2048, "n_threads": 1}
    config["aliases"]["example"] = {"local": "qwen", "upstream": "up", "routing": yaml.safe_load(example)}
    code, out, err = check(config, tmp_path, capsys)
    assert (code, err) == (0, "") and "example" in out


def test_a_preset_expands_as_documented_and_fields_beside_it_win():
    from gateway.presets import PRESETS
    from gateway.settings import RoutingSettings

    billed = RoutingSettings(preset="token-billed")
    assert {key: getattr(billed, key) for key in PRESETS["token-billed"]} == PRESETS["token-billed"] == {
        "policy": "learned", "target_fraction": 0.05, "threshold_from": "traffic",
        "router": "routers/mixed-qwen2.5-coder-0.5b.json", "answer_value": 1.0, "escalation": "draft"}
    hosted = RoutingSettings(preset="self-hosted", target_fraction=0.1)
    assert (hosted.policy, hosted.target_fraction, hosted.answer_value) == ("learned", 0.1, None)


def test_a_preset_whose_router_is_for_another_local_model_falls_back_and_says_so(tmp_path, capsys):
    """The embedded SmolLM2 has no fitted router: token-billed gets the agreement check instead."""
    config = gateway_config("http://127.0.0.1:9/v1")
    config["aliases"]["routed"]["routing"] = {"preset": "token-billed"}
    config["aliases"]["hosted"] = {"local": "smol", "upstream": "up", "routing": {"preset": "self-hosted"}}
    code, out, err = check(config, tmp_path, capsys)
    assert code == 0 and "config ok" in out
    assert "alias 'routed': preset 'token-billed' has no router for its local model" in err
    assert "falls back to {'policy': 'never', 'answer_check': {'kind': 'agreement', 'samples': 4}" in err
    assert "alias 'hosted': preset 'self-hosted'" in err and "'policy': 'entropy', 'threshold': 2.0" in err


def test_a_preset_keeps_its_router_for_the_model_it_was_fitted_for(tmp_path, capsys):
    config = gateway_config("http://127.0.0.1:9/v1")
    config["models"]["local"]["qwen"] = {"gguf": "qwen2.5-coder-0.5b-instruct"}
    config["aliases"]["routed"] = {"local": "qwen", "upstream": "up", "routing": {"preset": "token-billed"}}
    code, out, err = check(config, tmp_path, capsys)
    assert code == 0 and "config ok" in out and "falls back" not in err
