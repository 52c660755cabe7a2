"""Shared fixtures: real model files, real upstream server processes, real Redis, live gateways."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from adapters.model_files import resolve_model
from adapters.upstream_server import server_command
from gateway.settings import LaunchSettings

ROOT = Path(__file__).resolve().parent.parent
SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
DEMO_KEY = "sk-demo"
ADMIN_KEY = "sk-test-admin"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def smol_path() -> Path:
    return resolve_model(SMOL)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return resolve_model(QWEN)


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s}s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def upstream_server(gguf: Path, alias: str, server: str = "llama-cpp-python",
                    extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    """A real OpenAI-compatible server process on loopback (llama-cpp-python's or llama.cpp's
    llama-server, started as the gateway starts them); yields its /v1 base URL."""
    port = free_port()
    launch = LaunchSettings(gguf=str(gguf), server=server, n_threads=1, n_ctx=2048, extra_args=list(extra_args))
    process = subprocess.Popen(server_command(gguf, launch, port, alias),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", process)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(process)


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


def gateway_config(upstream_base: str | None, template_gguf: str = SMOL, mode: str = "completions",
                   **overrides) -> dict:
    """A config for a test gateway: SmolLM2 local, the given upstream (completions mode against
    llama-cpp-python's server, tokens mode against llama-server), one tenant."""
    config: dict = {
        "server": {"host": "127.0.0.1", "port": free_port(), "queue_limit": 8},
        "models": {"local": {"smol": {"gguf": SMOL, "n_ctx": 2048, "n_threads": 1}}},
        "upstreams": {},
        "aliases": {"local": {"local": "smol", "routing": {"policy": "never"}}},
        "store": {"backend": "memory"},
        "tenants": [{"id": "demo", "api_key_env": "TEST_DEMO_KEY"}],
        "admin_key_env": "TEST_ADMIN_KEY",
    }
    if upstream_base:
        config["upstreams"]["up"] = {
            "model": "text-completion-openai/up", "api_base": upstream_base, "mode": mode,
            "template_gguf": template_gguf, "timeout_s": 30, "retries": 0,
            "extra_body": {"repeat_penalty": 1.0},
            "input_usd_per_mtok": 0.5, "output_usd_per_mtok": 1.5,
            # one tenant, and a server started without slot isolation: its cache counts are reported
            # as they are (tests/test_security.py checks tenant isolation on a launched llama-server)
            "cache_isolation": "shared",
        }
        config["aliases"]["routed"] = {"local": "smol", "upstream": "up",
                                       "routing": {"policy": "entropy", "threshold": 1.0}}
    for key, value in overrides.items():
        config[key] = value
    return config


class LiveGateway:
    """A gateway process (`python -m gateway serve`) with its own config file."""

    def __init__(self, config: dict, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.port = config["server"]["port"]
        self.base_url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"gateway-{uuid.uuid4().hex[:8]}.yaml"
        path.write_text(yaml.safe_dump(config))
        environ = {**os.environ, "TEST_DEMO_KEY": DEMO_KEY, "TEST_ADMIN_KEY": ADMIN_KEY, **(env or {})}
        self.log_path = path.with_suffix(".log")
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path)],
                                        cwd=ROOT, env=environ, stdout=self._log, stderr=subprocess.STDOUT)
        wait_http(f"{self.base_url}/health/ready", self.process)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, key: str = DEMO_KEY) -> openai.OpenAI:
        """The openai SDK pointed at this gateway, without retries (a test sees every answer)."""
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0)

    def close(self) -> None:
        stop(self.process)
        self._log.close()


@contextlib.contextmanager
def live_gateway(config: dict, tmp: Path, env: dict[str, str] | None = None) -> Iterator[LiveGateway]:
    gateway = LiveGateway(config, tmp, env)
    try:
        yield gateway
    finally:
        gateway.close()


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

    workdir, ports = tmp_path_factory.mktemp("redis-cluster"), [_cluster_port() for _ in range(3)]
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


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (and so below 55536)."""
    import random

    while True:
        port = random.randint(20_000, 45_000)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
        return port


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
    from eval.learn import train
    from tests.fakes import synthetic

    router = train(synthetic(60, 0), [0.1, 0.2], sha or model_sha256(SMOL), {"command": "test"}).to_json()
    path = directory / "router.json"
    path.write_text(json.dumps({**router, **changes}))
    return str(path)
