"""Start-up: bad inputs stop the gateway with one clear line; an unreachable Redis does not."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import httpx
import pytest
import yaml

from adapters import model_files
from tests.conftest import ROOT, gateway_config, live_gateway, router_file

pytestmark = pytest.mark.integration


def start(config_text: str, tmp_path, env: dict | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "config.yaml"
    path.write_text(config_text)
    environ = {**os.environ, "TEST_DEMO_KEY": "sk-x", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=120)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[0]


def test_malformed_yaml(tmp_path):
    assert "not valid YAML at line 2" in one_line_error(start("server:\n  port: 8000: 1\n", tmp_path))


def test_unknown_key_is_named(tmp_path):
    config = gateway_config(None)
    config["server"]["prot"] = 1
    assert "server.prot" in one_line_error(start(yaml.safe_dump(config), tmp_path))


def test_wrong_model_path(tmp_path):
    config = gateway_config(None)
    config["models"]["local"]["smol"]["gguf"] = str(tmp_path / "missing.gguf")
    assert "model file not found" in one_line_error(start(yaml.safe_dump(config), tmp_path))


def test_corrupt_model_file(tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    config = gateway_config(None)
    config["models"]["local"]["smol"]["gguf"] = str(corrupt)
    assert "cannot load model" in one_line_error(start(yaml.safe_dump(config), tmp_path))


def test_corrupt_catalog_model_is_caught_by_its_checksum(tmp_path):
    from adapters.model_files import CATALOG, ModelFileError, resolve_model

    entry = CATALOG["smollm2-135m-instruct"]
    (tmp_path / entry.filename).write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelFileError, match="corrupt"):
        resolve_model("smollm2-135m-instruct", cache_dir=tmp_path)


def test_malformed_redis_url(tmp_path):
    config = gateway_config(None, store={"backend": "redis", "url": "http://localhost:6379"})
    assert "store.url" in one_line_error(start(yaml.safe_dump(config), tmp_path))


def test_unreachable_redis_starts_local_only(tmp_path):
    config = gateway_config(None, store={"backend": "redis", "url": "redis://127.0.0.1:1/0", "timeout_s": 0.2})
    with live_gateway(config, tmp_path) as gateway:
        ready = httpx.get(f"{gateway.base_url}/health/ready").json()
        assert ready["status"] == "ready" and ready["mode"] == "local_only" and ready["store"] == "unavailable"
        response = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": "Bearer sk-demo"},
                              json={"model": "local", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert response.status_code == 200


@pytest.mark.parametrize("problem, expected", [
    ("another model", "was trained for the local model with sha256 000"),
    ("unfitted share", "fitted for shares 0.1, 0.2: 0.5 is outside them"),
    ("no shares", "is not a complete router file"),
    ("short weights", "is not a usable router"),
])
def test_a_router_the_gateway_cannot_use_is_refused_at_startup(tmp_path, problem, expected):
    path = {"another model": lambda: router_file(tmp_path, sha="0" * 64),
            "unfitted share": lambda: router_file(tmp_path),
            "no shares": lambda: router_file(tmp_path, shares=None),
            "short weights": lambda: router_file(tmp_path, weights=[1.0, 2.0])}[problem]()
    config = gateway_config(None)
    share = 0.5 if problem == "unfitted share" else 0.1
    config["aliases"]["learned"] = {"local": "smol", "routing": {"policy": "learned", "target_fraction": share,
                                                                 "router": path}}
    assert expected in one_line_error(start(yaml.safe_dump(config), tmp_path))


def test_a_draft_whose_upstream_has_no_prices_is_refused_at_startup(tmp_path):
    config = gateway_config("http://127.0.0.1:9/v1")  # never called: the gateway stops before serving
    for price in ("input_usd_per_mtok", "output_usd_per_mtok"):
        del config["upstreams"]["up"][price]  # an unknown model: no prices in litellm's map either
    config["aliases"]["routed"]["routing"].update(answer_value=1, escalation="draft")
    assert "aliases.routed: routing.escalation 'draft' needs an upstream with prices" in \
        one_line_error(start(yaml.safe_dump(config), tmp_path))


def chat(gateway, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=60, headers={"Authorization": "Bearer sk-demo"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra})


def test_a_tenant_override_that_refuses_requests_is_named_at_startup_and_a_request_may_complete_it(tmp_path):
    config = gateway_config("http://127.0.0.1:9/v1")  # an upstream that is down: requests degrade to local
    config["tenants"][0].update(routing={"escalation": "draft"}, aliases=["routed"])
    with live_gateway(config, tmp_path) as gateway:
        assert ("tenants.demo on alias routed: requests without routing of their own get a 400: routing.escalation "
                "'draft' needs answer_value") in gateway.log_path.read_text()
        refused = chat(gateway, "routed")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "routing.escalation"
        assert chat(gateway, "routed", routing={"answer_value": 1}).status_code == 200


def test_a_tenant_share_outside_the_routers_fitted_shares_is_named_at_startup(tmp_path):
    config = gateway_config(None)
    config["aliases"]["learned"] = {"local": "smol", "routing": {"policy": "learned", "target_fraction": 0.1,
                                                                 "router": router_file(tmp_path)}}
    config["tenants"][0].update(routing={"target_fraction": 0.5}, aliases=["learned"])
    with live_gateway(config, tmp_path) as gateway:
        assert ("tenants.demo on alias learned: requests without routing of their own get a 400: the router's thresholds "
                "are fitted for shares 0.1, 0.2: 0.5 is outside them") in gateway.log_path.read_text()
        assert chat(gateway, "learned").json()["error"]["param"] == "routing.target_fraction"


def test_a_model_given_by_path_is_hashed_once_until_its_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    reads = []
    monkeypatch.setattr(model_files, "sha256_of",
                        lambda p: reads.append(p) or hashlib.sha256(p.read_bytes()).hexdigest())
    first = model_files.model_sha256(str(path))
    assert model_files.model_sha256(str(path)) == first and len(reads) == 1  # start-up, reload, learner: one read
    path.write_bytes(b"GGUF" + b"\1" * 60)
    os.utime(path, ns=(1, 1))  # another file at the same path
    assert model_files.model_sha256(str(path)) != first and len(reads) == 2
