"""The README's serve command, verbatim: it starts, routes to its loopback upstream, and drains on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port, wait_http

pytestmark = pytest.mark.integration


def readme_command(index: int) -> str:
    """The index-th command of the README's first code block, without its comment."""
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()[index].split("#", 1)[0].strip()


def upstream_server_pids() -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmdline[0].endswith(b"llama-server") and b"qwen-0.5b" in cmdline:
                pids.add(int(proc.name))
    return pids


def test_readme_serve_command_routes_and_drains(tmp_path):
    command = readme_command(0)
    assert command.endswith("python -m gateway serve")
    port = free_port()
    before = upstream_server_pids()
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "GATEWAY_SERVER__PORT": str(port)}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/health/ready", process, timeout_s=240)
        # bash execs the command's last step, so `process` is the gateway and its exit status the gateway's.
        assert b"gateway\0serve" in Path(f"/proc/{process.pid}/cmdline").read_bytes()
        children = upstream_server_pids() - before
        assert children, "the serve command should start its loopback upstream"
        headers = {"Authorization": "Bearer sk-demo"}
        body = {"model": "smollm2-routed", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8, "temperature": 0, "routing": {"policy": "always"}}
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120).json()
        assert answer["usage"]["routing"]["upstream_tokens"] > 0, answer

        # SIGTERM while a stream is in flight: the stream finishes, then everything stops.
        stream_body = {**body, "max_tokens": 40, "stream": True, "routing": {"policy": "never"}}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=stream_body, headers=headers, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
            os.killpg(process.pid, signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        # Once the stream has drained the gateway stops on the SIGTERM (uvicorn re-raises the signal
        # it caught), not on an error and not by the time-out.
        assert process.wait(timeout=60) == -signal.SIGTERM, f"exit status {process.returncode}"
        assert not (upstream_server_pids() & children), "the loopback upstream must stop with the gateway"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
