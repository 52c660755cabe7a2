"""One request cannot take the local model from the others (security round four): a real gateway
whose engine has two sequences and room for two waiting requests, and a tenant sending agreement
requests of many answers."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.conftest import DEMO_KEY, gateway_config, live_gateway

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Tell me a long story about a dragon."}]
KEYS = {"TEST_HEAVY_KEY": "sk-heavy", "TEST_METERED_KEY": "sk-metered"}


def agreement(samples: int) -> dict:
    return {"routing": {"answer_check": {"kind": "agreement", "samples": samples, "temperature": 2.0, "format": "text"}}}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    config = gateway_config(None)
    config["server"]["queue_limit"] = 2
    config["models"]["local"]["smol"]["parallel"] = 2
    config["tenants"] += [
        {"id": "heavy", "api_key_env": "TEST_HEAVY_KEY", "rate_limits": {"max_parallel": 1}},
        {"id": "metered", "api_key_env": "TEST_METERED_KEY", "rate_limits": {"tokens_per_minute": 300}},
    ]
    with live_gateway(config, tmp_path_factory.mktemp("fair"), env=KEYS) as running:
        yield running


def client(gateway, key: str = DEMO_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)


def queue_depth(gateway) -> int:
    ready = httpx.get(f"{gateway.base_url}/health/ready").json()
    return ready["queue_depth"]["smol"]


def test_a_request_of_sixteen_answers_keeps_no_other_tenant_waiting(gateway):
    """Before: its 16 sequences filled the queue (limit 2) and every other request was a 503 until
    they had all decoded."""
    done = threading.Event()

    def heavy():
        client(gateway, "sk-heavy").chat.completions.create(
            model="local", messages=QUESTION, max_tokens=48, n=2, extra_body=agreement(8))
        done.set()

    worker = threading.Thread(target=heavy)
    worker.start()
    deadline = time.monotonic() + 30
    while queue_depth(gateway) < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queue_depth(gateway) >= 10  # most of its answers are waiting for a sequence
    small = client(gateway).chat.completions.create(model="local", messages=QUESTION, max_tokens=4)
    assert small.choices[0].message.content and not done.is_set()  # answered while the heavy one decodes
    worker.join(120)
    assert done.is_set()


def test_more_answers_than_a_request_may_decode_is_a_400_naming_the_samples(gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        client(gateway).chat.completions.create(model="local", messages=QUESTION, max_tokens=4, n=8,
                                                extra_body=agreement(8))
    assert caught.value.body["param"] == "routing.answer_check.samples" and "64" in caught.value.message


def test_an_agreement_checks_samples_count_against_tokens_per_minute(gateway):
    """8 answers of up to 40 tokens are 320 tokens: past a limit of 300 a minute, though one is 40."""
    with pytest.raises(openai.RateLimitError):
        client(gateway, "sk-metered").chat.completions.create(model="local", messages=QUESTION, max_tokens=40,
                                                              extra_body=agreement(8))
    answer = client(gateway, "sk-metered").chat.completions.create(model="local", messages=QUESTION, max_tokens=40,
                                                                   extra_body=agreement(2))
    assert answer.usage.completion_tokens > 0
