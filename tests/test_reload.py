"""Configuration reloaded without a restart, on a real gateway process (`python -m gateway serve`)
with a real upstream llama-server: POST /admin/reload and SIGHUP re-read the file, check it as
start-up does, and serve it; a bad file is refused whole while the running configuration serves on;
a streamed answer started before a reload finishes on the configuration it started with. In
process, on a real model: a model the reload drops is freed only after the request admitted on it,
and after any call a cancelled request's worker thread still runs on it."""

from __future__ import annotations

import asyncio
import copy
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from llama_cpp import Llama
from llama_cpp.llama_grammar import JSON_GBNF

from adapters import local_model as local_model_module
from adapters.grammar import Grammar
from adapters.memory_store import MemoryStore
from adapters.vocabulary import tokenize_parts
from bench.support import load
from gateway import runtime as runtime_module
from gateway.admission.chat import admit
from gateway.runtime import Runtime
from gateway.settings import load_settings
from gateway.wire.schemas import ChatCompletionRequest
from tests.conftest import ADMIN_KEY, DEMO_KEY, LiveGateway, gateway_config, live_gateway

pytestmark = pytest.mark.integration

COUNTING = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]


@pytest.fixture(scope="module")
def gateway(smol_llama_server: str, tmp_path_factory) -> Iterator[LiveGateway]:
    config = gateway_config(smol_llama_server, mode="tokens")
    config["aliases"]["routed"]["routing"] = {"policy": "always"}
    with live_gateway(config, tmp_path_factory.mktemp("reload")) as running:
        yield running


@pytest.fixture
def original(gateway: LiveGateway) -> Iterator[dict]:
    """The gateway's configuration; each test's changes are reloaded away after it."""
    yield copy.deepcopy(gateway.config)
    write(gateway, gateway.config)
    assert reload(gateway).status_code == 200


def config_path(gateway: LiveGateway) -> Path:
    return gateway.log_path.with_suffix(".yaml")  # LiveGateway writes gateway-<id>.yaml beside its .log


def write(gateway: LiveGateway, config: dict) -> None:
    config_path(gateway).write_text(yaml.safe_dump(config))


def reload(gateway: LiveGateway, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gateway.base_url}/admin/reload", headers=headers, timeout=60)


def served(gateway: LiveGateway) -> set[str]:
    return {model.id for model in gateway.client().models.list()}


def test_a_reload_changes_routing_while_a_streamed_answer_finishes_intact(gateway, original):
    chunks: list[tuple[float, object]] = []
    first = threading.Event()

    def read() -> None:
        stream = gateway.client().chat.completions.create(
            model="routed", messages=COUNTING, max_tokens=120, temperature=0, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            chunks.append((time.monotonic(), chunk))
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    changed = copy.deepcopy(original)
    changed["aliases"]["routed"]["routing"] = {"policy": "never"}
    changed["aliases"]["fresh"] = {"local": "smol", "routing": {"policy": "never"}}
    write(gateway, changed)
    answer = reload(gateway)
    reloaded_at = time.monotonic()
    reader.join(120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["aliases"] == ["fresh", "local", "routed"]
    assert not any(line.startswith("models.local.") for line in answer.json()["warnings"])  # smol kept, not reloaded
    assert any(at > reloaded_at for at, _ in chunks)  # the answer was still streaming when the reload took effect
    content = [chunk for _, chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert content[-1].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1][1].usage
    routing = usage.model_extra["routing"]
    assert routing["policy"] == "always" and routing["upstream_calls"] > 0  # the routing it started with
    assert routing["degraded"] == []
    assert usage.completion_tokens == routing["local_tokens"] + routing["upstream_tokens"] + routing["cache_tokens"]
    assert len({chunk.id for _, chunk in chunks}) == 1 and "1, 2" in "".join(c.choices[0].delta.content for c in content)
    after = gateway.client().chat.completions.create(model="routed", messages=COUNTING, max_tokens=8, temperature=0)
    assert after.usage.model_extra["routing"]["policy"] == "never"
    assert after.usage.model_extra["routing"]["upstream_calls"] == 0
    assert "fresh" in served(gateway)


def test_a_new_local_entry_loads_and_an_unchanged_one_is_kept(gateway, original):
    changed = copy.deepcopy(original)
    changed["models"]["local"]["smol-wide"] = {**original["models"]["local"]["smol"], "n_ctx": 1024}
    changed["aliases"]["wide"] = {"local": "smol-wide", "routing": {"policy": "never"}}
    changed["upstreams"]["up"]["output_usd_per_mtok"] = 3.0  # a changed upstream, built anew
    write(gateway, changed)
    answer = reload(gateway)
    assert answer.status_code == 200, answer.text
    assert [line for line in answer.json()["warnings"] if line.startswith("models.local.")] == [
        "models.local.smol-wide: loaded"]
    wide = gateway.client().chat.completions.create(model="wide", messages=COUNTING, max_tokens=4, temperature=0)
    assert wide.choices[0].message.content
    fresh = [{"role": "user", "content": "Name three colours."}]  # not in the continuation cache
    routed = gateway.client().chat.completions.create(model="routed", messages=fresh, max_tokens=4, temperature=0)
    assert routed.usage.model_extra["routing"]["upstream_calls"] > 0  # on the upstream built anew


@pytest.mark.parametrize("breakage, named", [
    (lambda c: c["aliases"]["extra"].update(local="missing"), "aliases.extra.local"),  # the settings' own check
    (lambda c: c["aliases"]["extra"]["routing"].update(policy="learned", router="no-such-router.json", threshold=0.5),
     "no-such-router.json"),  # a check start-up makes beyond the settings: the router file
    (lambda c: c["upstreams"]["up"].update(template_gguf="/no/such/template.gguf"),
     "/no/such/template.gguf"),  # found as the changed upstream is built, after the checks
])
def test_a_file_that_fails_its_checks_is_refused_whole(gateway, original, breakage, named):
    broken = copy.deepcopy(original)
    broken["aliases"]["routed"]["routing"] = {"policy": "never"}  # a good change beside the bad one
    broken["aliases"]["extra"] = {"local": "smol", "routing": {"policy": "never"}}
    breakage(broken)
    write(gateway, broken)
    answer = reload(gateway)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_configuration"
    assert named in error["message"]
    assert served(gateway) == {"local", "routed"}  # nothing of the file is served
    still = gateway.client().chat.completions.create(model="routed", messages=COUNTING, max_tokens=4, temperature=0)
    assert still.usage.model_extra["routing"]["policy"] == "always"


def test_a_reload_cannot_make_a_tenant_created_through_the_api_the_shadow_operator(gateway, original):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    created = httpx.post(f"{gateway.base_url}/admin/tenants", json={"id": "acme"}, headers=admin, timeout=30)
    assert created.status_code == 201, created.text
    changed = copy.deepcopy(original)
    changed.setdefault("shadow", {})["operator"] = "acme"  # no tenant of the file has that id
    write(gateway, changed)
    answer = reload(gateway)
    assert answer.status_code == 400 and "shadow.operator" in answer.json()["error"]["message"]


def test_the_reload_route_is_the_admin_keys(gateway):
    assert reload(gateway, key=DEMO_KEY).status_code == 403  # a tenant's key
    assert reload(gateway, key="sk-wrong").status_code == 401
    assert reload(gateway, key=None).status_code == 401


def test_sighup_reloads_and_a_bad_file_is_logged_and_refused(gateway, original):
    changed = copy.deepcopy(original)
    changed["aliases"]["hup"] = {"local": "smol", "routing": {"policy": "never"}}
    write(gateway, changed)
    gateway.process.send_signal(signal.SIGHUP)
    until(lambda: "hup" in served(gateway))
    broken = copy.deepcopy(changed)
    broken["aliases"]["hup"]["local"] = "missing"
    write(gateway, broken)
    gateway.process.send_signal(signal.SIGHUP)
    until(lambda: "configuration reload refused" in gateway.logs())
    assert "aliases.hup.local" in gateway.logs()
    assert "hup" in served(gateway) and gateway.process.poll() is None  # the running configuration serves on


def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_branch_that_needs_a_restart_is_kept_and_named(gateway, original):
    changed = copy.deepcopy(original)
    changed["server"]["default_max_tokens"] = 3
    write(gateway, changed)
    answer = reload(gateway)
    assert answer.status_code == 200
    assert "server: changed in the file, kept as running until a restart" in answer.json()["warnings"]
    kept = gateway.client().chat.completions.create(model="local", messages=COUNTING, temperature=0)
    assert kept.usage.completion_tokens > 3  # the running default (256), not the file's


# -- a model a reload drops, with a request still on it (in process) --

class SlowAdmission(MemoryStore):
    """The in-process Store whose admissions wait until `go` is set: a Redis slow to answer, which
    keeps a request between picking its alias and taking a sequence of the alias's model."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting, self.go = asyncio.Event(), asyncio.Event()

    async def admit(self, *args, **kwargs):
        self.waiting.set()
        await self.go.wait()
        return await super().admit(*args, **kwargs)


class HeldCall:
    """`call` on `llm`'s model, whose first call waits on its thread until `go` is set (as a long
    prompt keeps its thread), then goes on only if the model is not freed by then: a call on a
    freed model would crash the test run instead of failing its test."""

    def __init__(self, call: Callable, llm: Llama) -> None:
        self.call, self.llm = call, llm
        self.started, self.go = threading.Event(), threading.Event()

    def __call__(self, *args):
        if not self.started.is_set():
            self.started.set()
            self.go.wait(30)
        if freed(self.llm):
            raise RuntimeError("a call on a freed model")
        return self.call(*args)


def loaded(runtime: Runtime, model) -> bool:
    """Whether `model` is still loaded (not yet freed) in `runtime`."""
    return any(held is model for held in runtime.models_by_settings.values())


def freed(llm: Llama) -> bool:
    """Whether the weights of `llm` (a LocalModel's) were freed."""
    return llm._model.model is None  # noqa: SLF001 - llama-cpp-python's handle, None once freed


async def soon(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Whether `condition` holds within `timeout_s` (checked every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return condition()


async def started_runtime(config: dict, path: Path) -> Runtime:
    """A runtime serving `config`, written to `path`, which its reloads re-read."""
    path.write_text(yaml.safe_dump(config))
    return await Runtime.start(load_settings(path), environ={"TEST_DEMO_KEY": DEMO_KEY, "TEST_ADMIN_KEY": ADMIN_KEY},
                               load_settings=lambda: load_settings(path))


async def reload_dropping_smol(runtime: Runtime, config: dict, path: Path) -> None:
    """Reload with smol's entry changed: a new model serves it, the running one is dropped."""
    dropped = runtime.local_models["smol"]
    config["models"]["local"]["smol"]["n_ctx"] = 1024
    path.write_text(yaml.safe_dump(config))
    assert "models.local.smol: loaded" in await runtime.reload()
    assert runtime.local_models["smol"] is not dropped


async def test_a_model_a_reload_drops_serves_the_request_admitted_on_it_and_is_freed_after(tmp_path, monkeypatch):
    store = SlowAdmission()
    monkeypatch.setattr(runtime_module, "_store", lambda settings: store)
    monkeypatch.setattr(runtime_module, "RETIRE_POLL_S", 0.05)
    config, path = gateway_config(None), tmp_path / "gateway.yaml"
    runtime = await started_runtime(config, path)
    dropped = runtime.local_models["smol"]
    body = ChatCompletionRequest(model="local", messages=COUNTING, max_tokens=8, temperature=0)
    admitting = asyncio.create_task(admit(runtime, runtime.tenants.authenticate(DEMO_KEY), body))
    try:
        await asyncio.wait_for(store.waiting.wait(), 30)  # the request has its alias, not yet a sequence
        await reload_dropping_smol(runtime, config, path)
        await asyncio.sleep(0.5)  # ten retirement polls
        assert loaded(runtime, dropped)  # not freed under the request
        store.go.set()
        admitted = await asyncio.wait_for(admitting, 30)
        assert admitted.alias.local is dropped
        pieces = [piece async for _, piece in admitted.pieces()]
        await admitted.release()
        assert "".join(piece.text for piece in pieces).strip()  # answered on the model it was admitted on
        assert await soon(lambda: not loaded(runtime, dropped))  # freed once the request ended
        assert not runtime.holds
    finally:
        admitting.cancel()  # a request still waiting must not go on to a model freed under it
        await runtime.close()


async def test_a_model_a_reload_drops_is_freed_only_after_a_cancelled_requests_thread_returns(tmp_path, monkeypatch):
    """A client leaves while its prompt is tokenized on a worker thread: the request unwinds and gives
    its hold back at once, but the thread tokenizes on, so the dropped model waits for it."""
    monkeypatch.setattr(runtime_module, "RETIRE_POLL_S", 0.05)
    config, path = gateway_config(None), tmp_path / "gateway.yaml"
    runtime = await started_runtime(config, path)
    dropped = runtime.local_models["smol"]
    tokenizing = HeldCall(tokenize_parts, dropped._llm)  # noqa: SLF001 - the weights the free must wait for
    monkeypatch.setattr(local_model_module, "tokenize_parts", tokenizing)
    body = ChatCompletionRequest(model="local", messages=COUNTING, max_tokens=8, temperature=0)
    admitting = asyncio.create_task(admit(runtime, runtime.tenants.authenticate(DEMO_KEY), body))
    try:
        assert await asyncio.to_thread(tokenizing.started.wait, 30)
        admitting.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await admitting
        assert not runtime.holds  # given back while its thread still tokenizes
        await reload_dropping_smol(runtime, config, path)
        await asyncio.sleep(0.5)  # ten retirement polls
        assert not freed(dropped._llm)  # not under the thread's call
        tokenizing.go.set()
        assert await soon(lambda: freed(dropped._llm))  # freed once the call returned
    finally:
        tokenizing.go.set()
        await runtime.close()


async def test_a_grammar_check_on_a_worker_thread_holds_off_its_models_free(smol_path, monkeypatch):
    """A grammar's mask (a decoding step's, on a worker thread) reads its model's vocabulary: the model
    is freed only once the mask returns."""
    model = await load(smol_path, parallel=1)
    llm = model._llm  # noqa: SLF001 - the weights the free must wait for
    grammar = model.grammar(JSON_GBNF)
    masking = HeldCall(Grammar.mask, llm)
    monkeypatch.setattr(Grammar, "mask", lambda state, *args: masking(state, *args))
    mask = asyncio.ensure_future(asyncio.to_thread(grammar.mask, [], np.zeros(model.n_vocab, dtype=np.float32)))
    assert await asyncio.to_thread(masking.started.wait, 30)
    closing = asyncio.ensure_future(asyncio.to_thread(model.close))
    try:
        await asyncio.sleep(0.3)
        assert not freed(llm)  # not under the mask
    finally:
        masking.go.set()
    await closing
    assert freed(llm) and np.isinf(await mask).any()  # freed once the mask returned, which forbade tokens
    grammar.close()
