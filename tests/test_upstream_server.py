"""The embedded upstream server: a child process that the gateway starts again when it dies."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from adapters.upstream_server import UpstreamServer
from gateway.settings import LaunchSettings

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("kind", ["llama-server", "llama-cpp-python"])
async def test_a_killed_child_server_is_started_again(smol_path, kind):
    server = UpstreamServer(smol_path, LaunchSettings(gguf=str(smol_path), server=kind, n_ctx=512), alias="smol")
    supervisor = None
    try:
        await server.wait_ready()
        supervisor = asyncio.create_task(server.supervise(interval_s=0.2))
        first = server.pid
        os.kill(first, signal.SIGKILL)
        for _ in range(600):
            if server.restarts == 1 and server.pid != first:
                break
            await asyncio.sleep(0.1)
        await server.wait_ready(timeout_s=60)
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{server.api_base}/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert server.restarts == 1 and response.status_code == 200
    finally:
        if supervisor is not None:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        server.stop()
