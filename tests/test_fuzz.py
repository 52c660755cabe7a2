"""Fuzz the chat endpoint with generated bodies and keys: never a 5xx, always OpenAI's error shape.

Run alone with: .venv/bin/python -m pytest tests/test_fuzz.py  (150 cases, fixed seed)
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.conftest import DEMO_KEY, gateway_config, live_gateway

pytestmark = pytest.mark.integration

CASES = 150
anything = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]),
     "content": st.text(max_size=40) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                         "text": st.text(max_size=10)}), max_size=2)
     | anything},
)
fields = {
    "model": st.sampled_from(["local", "nope"]) | anything,
    "messages": st.lists(message, min_size=0, max_size=3) | anything,
    "max_tokens": st.integers(-2, 3) | anything,
    "max_completion_tokens": st.integers(0, 3),
    "temperature": st.floats(-1, 3, allow_nan=False) | anything,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False),
    "seed": st.integers(-5, 5) | anything,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | anything,
    "stream": st.booleans() | anything,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | anything,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 25),
    "n": st.integers(0, 3),
    "user": st.text(max_size=10) | anything,
    "routing": st.fixed_dictionaries({}, optional={
        "policy": st.sampled_from(["never", "always", "entropy", "top1", "margin", "target_fraction", "x"]),
        "threshold": st.floats(-2, 5, allow_nan=False) | anything,
        "target_fraction": st.floats(-1, 2, allow_nan=False),
        "max_upstream_tokens": st.integers(-1, 5),
        "max_upstream_share": st.floats(-1, 2, allow_nan=False),
    }) | anything,
    "continue_final_message": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "tools": anything,
}
required = {"model": st.just("local"), "max_tokens": st.integers(1, 3),
            "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]),
                                                        "content": st.text(min_size=1, max_size=40)}),
                                 min_size=1, max_size=2)}
valid = st.fixed_dictionaries(required, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1), "seed": st.integers(0, 9), "stream": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "logprobs": st.booleans(),
    "routing": st.fixed_dictionaries({"policy": st.sampled_from(["never", "always"])}), "user": st.text(max_size=8),
})
mostly_valid = st.fixed_dictionaries(required, optional={k: v for k, v in fields.items() if k not in required})
bodies = valid | mostly_valid | st.fixed_dictionaries({}, optional=fields) | anything
keys = st.sampled_from([DEMO_KEY, DEMO_KEY, DEMO_KEY, "sk-wrong", None])


def check_response(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    with live_gateway(gateway_config(None), tmp_path_factory.mktemp("fuzz")) as gateway:
        yield gateway.base_url


def test_generated_requests_never_break_the_gateway(base_url):
    statuses: list[int] = []

    @seed(20261130)
    @settings(max_examples=CASES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(body=bodies, key=keys)
    def one(body, key):
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        with httpx.Client(timeout=60) as http:
            response = http.post(f"{base_url}/v1/chat/completions", content=json.dumps(body), headers=headers)
        statuses.append(response.status_code)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.status_code == 200
            assert '"error"' not in response.text or "data: {\"error\"" in response.text
            return
        check_response(response)

    one()
    # the generator reached both the decoder and the validators, with and without valid keys
    assert {200, 400, 401} <= set(statuses), sorted(set(statuses))
    assert statuses.count(200) >= 10
