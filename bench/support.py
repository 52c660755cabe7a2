"""Processes and models that the benchmarks and the tests both start: upstream servers, gateways,
Redis ports, and the local model's engine as the engine tests load it.

tests/conftest.py builds its fixtures from these; bench/ imports them from here, never from tests/.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import openai
import yaml

from adapters.upstream_server import free_port, server_command
from gateway.settings import LaunchSettings

if TYPE_CHECKING:  # llama.cpp loads only for what decodes
    from adapters.local_model import LocalModel

ROOT = Path(__file__).resolve().parent.parent
SMOL = "smollm2-135m-instruct"
DEMO_KEY = "sk-demo"
ADMIN_KEY = "sk-test-admin"


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
                    extra_args: tuple[str, ...] = (), n_threads: int = 1, n_ctx: int = 2048) -> Iterator[str]:
    """A real OpenAI-compatible server process on loopback (llama-cpp-python's or llama.cpp's
    llama-server, started as the gateway starts them); yields its /v1 base URL."""
    port = free_port()
    launch = LaunchSettings(gguf=str(gguf), server=server, n_threads=n_threads, n_ctx=n_ctx,
                            extra_args=list(extra_args))
    process = subprocess.Popen(server_command(gguf, launch, port, alias),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", process)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(process)


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (and so below 55536)."""
    while True:
        port = random.randint(20_000, 45_000)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
        return port


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


# -- the local model's engine, loaded as the engine tests load it --

def prompt(local: LocalModel, system: str, user: str) -> list[int]:
    return local.tokenize_prompt(local.template.render_parts([{"role": "system", "content": system},
                                                              {"role": "user", "content": user}]))


async def load(path, parallel: int = 4, queue_limit: int = 4, look_ahead: bool = True,
               flash_attn: bool = True) -> LocalModel:
    from adapters.local_model import LocalModel

    return await LocalModel.load(path, n_ctx=1024, n_threads=1, n_batch=256, queue_limit=queue_limit, parallel=parallel,
                                 look_ahead=look_ahead, flash_attn=flash_attn)


async def greedy(local: LocalModel, tokens: list[int], steps: int, pause_every: int = 0,
                 scope: str = "", speculate: bool = False) -> tuple[list[int], list]:
    """`steps` greedy tokens after `tokens` on a sequence of its own (in cache `scope`), and each step's logits."""
    out, seen = [], []
    async with local.sequence(tokens, scope, speculate=speculate) as sequence:
        for step in range(steps):
            logits = await sequence.forward(tokens + out)
            seen.append(logits)
            out.append(int(np.argmax(logits)))
            if pause_every and step % pause_every == pause_every - 1:
                sequence.pause()  # as a request waiting for its upstream does
                await asyncio.sleep(0.05)
    return out, seen
