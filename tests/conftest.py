"""Shared fixtures: real model files, real upstream server processes, real Redis, live gateways.

The processes they start (servers, gateways) come from bench/support.py, which the benchmarks use
too; its names are importable from here as before.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from adapters.model_files import resolve_model
from bench.support import (  # noqa: F401  (re-exported: tests import them from here)
    ADMIN_KEY,
    DEMO_KEY,
    ROOT,
    SMOL,
    LiveGateway,
    cluster_port,
    free_port,
    gateway_config,
    live_gateway,
    stop,
    upstream_server,
    wait_http,
)

QWEN = "qwen2.5-coder-0.5b-instruct"


@contextlib.contextmanager
def private_redis(port: int, *options: str) -> Iterator[subprocess.Popen]:
    """A redis-server of the test's own on `port` (`options`: more of its flags; by default it keeps
    nothing on disk), answering before the block starts and stopped after it."""
    process = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                                "--save", "", *(options or ("--appendonly", "no"))], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=0.5)
    for _ in range(100):
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                break
        time.sleep(0.05)
    try:
        yield process
    finally:
        stop(process)


@pytest.fixture(scope="session")
def smol_path() -> Path:
    return resolve_model(SMOL)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return resolve_model(QWEN)


@pytest.fixture(scope="session")
def smol_upstream(smol_path: Path) -> Iterator[str]:
    with upstream_server(smol_path, "smol-upstream") as base:
        yield base


@pytest.fixture(scope="session")
def smol_tools_upstream(smol_path: Path) -> Iterator[str]:
    """llama-cpp-python's server with its grammar-driven tool calling (a named `tool_choice` always
    yields a call that fits the function's schema, even from a 135M model)."""
    with upstream_server(smol_path, "smol-tools", extra_args=("--chat_format", "chatml-function-calling")) as base:
        yield base


@pytest.fixture(scope="session")
def smol_llama_server(smol_path: Path) -> Iterator[str]:
    with upstream_server(smol_path, "smol-llama-server", server="llama-server") as base:
        yield base


@pytest.fixture(scope="session")
def qwen_upstream(qwen_path: Path) -> Iterator[str]:
    with upstream_server(qwen_path, "qwen-upstream") as base:
        yield base


@pytest.fixture(scope="module")
def tokens_gateway(smol_llama_server: str, tmp_path_factory) -> Iterator[LiveGateway]:
    """A gateway of the test module's own on the default test config, its upstream the shared
    llama-server in tokens mode."""
    with live_gateway(gateway_config(smol_llama_server, mode="tokens"), tmp_path_factory.mktemp("tokens")) as running:
        yield running


@pytest.fixture
def tokens_client(tokens_gateway: LiveGateway) -> openai.OpenAI:
    return tokens_gateway.client()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis on 127.0.0.1:6379 that CI starts; each test uses its own key prefix."""
    import redis

    url = "redis://127.0.0.1:6379/0"
    redis.Redis.from_url(url, socket_timeout=2).ping()
    return url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory) -> Iterator[str]:
    """A real Redis Cluster of three masters on loopback (redis-server --cluster-enabled yes), made
    with `redis-cli --cluster create`; yields the URL of one node."""
    import redis

    workdir, ports = tmp_path_factory.mktemp("redis-cluster"), [cluster_port() for _ in range(3)]
    nodes = [subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                               "--cluster-config-file", str(workdir / f"nodes-{port}.conf"), "--save", "",
                               "--appendonly", "no", "--dir", str(workdir)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    try:
        for port in ports:
            _wait_redis(port)
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while redis.Redis(host="127.0.0.1", port=ports[0]).cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not come up")
            time.sleep(0.2)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for node in nodes:
            stop(node)


def _wait_redis(port: int, timeout_s: float = 10.0) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def router_file(directory: Path, sha: str | None = None, **changes) -> str:
    """A router trained on the synthetic set, for SmolLM2 unless `sha` says otherwise."""
    from adapters.model_files import model_sha256
    from fitting.learn import train
    from tests.fakes import synthetic

    router = train(synthetic(60, 0), [0.1, 0.2], sha or model_sha256(SMOL), {"command": "test"}).to_json()
    path = directory / "router.json"
    path.write_text(json.dumps({**router, **changes}))
    return str(path)
