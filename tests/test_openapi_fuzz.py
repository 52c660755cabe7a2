"""Fuzz a live gateway with schemathesis from two OpenAPI descriptions (positive mode: bodies the schema accepts).

(a) OpenAI's published description of chat completions (tests/data/openai-chat-completions.openapi.json,
    narrowed for fuzzing, see tests/data/README.md): POST /chat/completions against <gateway>/v1;
(b) the gateway's own /openapi.json: every operation it describes, none skipped;
(c) OpenAI's published description of the Responses API (tests/data/openai-responses.openapi.json):
    POST /responses, GET and DELETE /responses/{id}.

The property: no response is a 5xx (schemathesis' `not_a_server_error`), except a 502 `upstream_unavailable`
that passes on the upstream's own failure for a request sent to it whole (counted and printed: the
llama-server upstream answers 500 to some message shapes it cannot parse), and every non-2xx response has
OpenAI's error shape {"error": {"message", "type", "param", "code"}}; for (a) and (c), whose bodies OpenAI
accepts, a 400 must also name the refused field in `param`. The share of (a)'s requests that were
served (2xx) is printed, not asserted. Fixed seed, bounded examples, loopback only: schemathesis is
given the specs as data and fetches nothing itself. The fuzzing itself (specs, checks, report) is
bench/openapi_fuzz.py's, which a longer run uses too.

Run alone with: .venv/bin/python -m pytest tests/test_openapi_fuzz.py -q -s
A longer run: .venv/bin/python -m bench.openapi_fuzz --examples 500
"""

from __future__ import annotations

import pytest

from bench.openapi_fuzz import (
    FuzzReport,
    fuzz,
    fuzz_gateway,
    load_gateway_spec,
    load_openai_spec,
    load_responses_spec,
    names_param_on_400,
)

pytestmark = pytest.mark.integration

OPENAI_EXAMPLES = 60
GATEWAY_EXAMPLES = 40
RESPONSES_EXAMPLES = 40


@pytest.fixture(scope="module")
def gateway(smol_llama_server, tmp_path_factory):
    with fuzz_gateway(tmp_path_factory.mktemp("openapi-fuzz"), smol_llama_server) as gateway:
        yield gateway


def show(capsys, report: FuzzReport) -> None:
    """The summary goes to the terminal even when pytest captures output (the 2xx share is reported, not asserted)."""
    with capsys.disabled():
        print("\n" + report.summary())


def test_openai_published_spec_positive_cases(gateway, capsys):
    report = fuzz(load_openai_spec(), f"{gateway.base_url}/v1", name="openai spec", examples=OPENAI_EXAMPLES,
                  extra_checks=(names_param_on_400,))
    show(capsys, report)
    assert report.total() >= OPENAI_EXAMPLES // 2, report.summary()  # hypothesis really generated cases
    assert not report.failures, "\n\n".join(report.failures[:10])


def test_openai_responses_spec_positive_cases(gateway, capsys):
    report = fuzz(load_responses_spec(), f"{gateway.base_url}/v1", name="openai responses spec",
                  examples=RESPONSES_EXAMPLES, extra_checks=(names_param_on_400,))
    show(capsys, report)
    assert report.total() >= RESPONSES_EXAMPLES, report.summary()  # hypothesis really generated cases
    assert not report.failures, "\n\n".join(report.failures[:10])


def test_gateway_own_spec_positive_cases(gateway, capsys):
    schema = load_gateway_spec(gateway.base_url)
    report = fuzz(schema, gateway.base_url, name="gateway spec", examples=GATEWAY_EXAMPLES)
    show(capsys, report)
    described = {result.ok().label for result in schema.get_all_operations()}
    assert set(report.statuses) == described, f"operations never called: {described - set(report.statuses)}"
    assert not report.failures, "\n\n".join(report.failures[:10])
