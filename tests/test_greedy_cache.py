"""The benchmarks' greedy-record proxy (bench/greedy_cache.py) in front of a counting test server."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx
import pytest

from adapters.upstream_server import free_port
from bench.greedy_cache import greedy_cache, request_key
from tests.fakes import JsonProvider, serve

ANSWERED = itertools.count(1)


class Counting(JsonProvider):
    """Answers each POST with a new number: two answers alike came from one call."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_json({"choices": [{"text": str(next(ANSWERED))}], "usage": {"prompt_tokens": 3}})


@pytest.fixture()
def counting() -> Iterator[str]:
    yield from serve(Counting)


def test_a_key_leaves_out_what_cannot_change_a_greedy_answer():
    body = {"prompt": [1, 2], "max_tokens": 4, "temperature": 0}
    key = request_key("/v1/completions", body)
    assert key == request_key("/v1/completions", {**body, "model": "x", "temperature": 0.0, "top_p": 1.0,
                                                  "seed": 7, "cache_prompt": True, "id_slot": 1})
    assert key == request_key("/v1/completions", {**body, "repeat_penalty": 1.0})
    assert key != request_key("/v1/completions", {**body, "max_tokens": 5})
    assert key != request_key("/v1/chat/completions", body)
    assert request_key("/v1/completions", {**body, "temperature": 0.7}) is None  # sampling: no record
    assert request_key("/tokenize", body) is None


def test_a_repeated_greedy_request_is_answered_from_the_record_and_a_sampled_one_is_asked(counting, tmp_path):
    port = free_port()
    with greedy_cache(counting.removesuffix("/v1"), tmp_path / "records.jsonl.gz", port) as records, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}/v1") as client:
        def ask(**body):
            return client.post("/completions", json={"prompt": "hi", "max_tokens": 2, **body}).json()

        first = ask(temperature=0)
        assert ask(temperature=0.0, seed=3) == first
        assert ask(temperature=0.8) != ask(temperature=0.8) != first
        assert (records.misses, records.hits) == (1, 1)
    with greedy_cache(counting.removesuffix("/v1"), tmp_path / "records.jsonl.gz", port) as resumed:
        assert json.loads(next(iter(resumed.answers.values()))["body"]) == first  # a resumed run reads them
