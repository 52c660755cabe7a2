"""An OpenAI-compatible server started as a child process: the embedded loopback upstream.

Either llama.cpp's own `llama-server` (the default: it keeps each sequence's KV cache between
calls, so a hand-off that extends the previous one evaluates only the new tokens, and it reports
its timings), built from the pinned llama-cpp-python sdist by scripts/setup.sh and linked into
the virtual environment's bin/, or `python -m llama_cpp.server`.

`supervise()` restarts the child on the same port when it dies; meanwhile hand-offs fail fast
(the upstream's circuit breaker opens) and requests are answered locally.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from adapters.upstream_settings import LaunchSettings

log = logging.getLogger("gateway.upstream_server")


class UpstreamServerError(Exception):
    """The child server did not start; the message is one line."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_root(api_base: str) -> str:
    """A llama-server's own root URL (where /slots, /tokenize and /apply-template live) from its
    OpenAI /v1 base URL."""
    return api_base.removesuffix("/").removesuffix("/v1")


async def slot_action(root: str, slot: int, action: str, timeout_s: float, filename: str | None = None) -> None:
    """One of llama-server's slot actions on one slot of the server at `root` (it must run with
    `forgetful_args`): erase it, save what it holds as `filename`, or restore that file into it."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        body = {"filename": filename} if filename else None
        (await client.post(f"{root}/slots/{slot}", params={"action": action}, json=body)).raise_for_status()


async def erase_slot(root: str, slot: int, timeout_s: float) -> None:
    """Empty one slot of the llama-server at `root` (it must run with `forgetful_args`)."""
    await slot_action(root, slot, "erase", timeout_s)


def llama_server_binary() -> str:
    """The `llama-server` next to this Python (scripts/setup.sh links it there), else on PATH."""
    beside = Path(sys.executable).parent / "llama-server"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("llama-server")
    if found is None:
        raise UpstreamServerError("llama-server not found: run scripts/setup.sh (it builds it), or set "
                                  "launch.server: llama-cpp-python")
    return found


def server_command(gguf: Path, launch: LaunchSettings, port: int, alias: str) -> list[str]:
    """The command line of the child server."""
    if launch.server == "llama-cpp-python":
        return [
            sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", alias,
            "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(launch.n_threads),
            "--n_threads_batch", str(launch.n_threads), "--n_ctx", str(launch.n_ctx), "--verbose", "False",
            *launch.extra_args,
        ]
    return [
        llama_server_binary(), "--model", str(gguf), "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(launch.n_threads), "--threads-batch", str(launch.n_threads),
        "--parallel", str(launch.parallel), "--kv-unified", "--kv-unified-per-slot", str(launch.n_ctx),
        "--jinja",  # the model's own chat template renders tools and tool results (pass-through requests)
        "--no-webui", "--log-disable", *launch.extra_args,
    ]


def forgetful_args() -> list[str]:
    """llama-server arguments that let `UpstreamServer.forget` (and tenant isolation) empty its
    slots: no prompt cache in RAM (it is shared by all slots), slot actions enabled."""
    return ["--cache-ram", "0", "--slot-save-path", tempfile.mkdtemp(prefix="llama-server-slots-")]


class UpstreamServer:
    """A child server on 127.0.0.1 (see `server_command`), stopped with the gateway (and with its parent)."""

    def __init__(self, gguf: Path, launch: LaunchSettings, alias: str, isolated: bool = False) -> None:
        self.port = launch.port or free_port()
        self.alias = alias
        self.api_base = f"http://127.0.0.1:{self.port}/v1"
        self.restarts = 0
        # Tenants isolated by slot (adapters.cache_isolation): no prompt cache outside the slots,
        # and slots that can be erased before another tenant uses them.
        self._command = server_command(gguf, launch, self.port, alias) + (forgetful_args() if isolated else [])
        # A file, not a pipe: a chatty child would block once a pipe nobody reads fills up.
        self._log = tempfile.NamedTemporaryFile(prefix=f"upstream-{alias}-", suffix=".log", delete=False)
        self._process = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        return subprocess.Popen(
            self._command, stdout=self._log, stderr=subprocess.STDOUT, env=environ,
            start_new_session=True, preexec_fn=_die_with_parent,
        )

    async def supervise(self, interval_s: float = 1.0) -> None:
        """Run until cancelled: start the child again whenever it has exited."""
        while True:
            await asyncio.sleep(interval_s)
            if self._process.poll() is None:
                continue
            log.warning("upstream server '%s' exited with %s; restarting it", self.alias, self._process.returncode)
            self._process = self._spawn()
            self.restarts += 1
            try:
                await self.wait_ready()
                log.warning("upstream server '%s' is back", self.alias)
            except UpstreamServerError as exc:
                log.error("upstream server '%s' did not come back: %s", self.alias, exc)

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until the server answers /v1/models and one completion (warms its lazy set-up)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise UpstreamServerError(
                        f"upstream server exited with {self._process.returncode}: {self.log_tail()}")
                try:
                    (await client.get(f"{self.api_base}/models")).raise_for_status()
                    body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
                    (await client.post(f"{self.api_base}/completions", json=body, timeout=60.0)).raise_for_status()
                    return
                except httpx.HTTPError:
                    await asyncio.sleep(0.25)
        self._terminate()
        raise UpstreamServerError(f"upstream server on port {self.port} not ready after {timeout_s:.0f}s")

    async def forget(self, slots: int, keep: str | None = None) -> None:
        """Erase what llama-server's `slots` sequences hold (it must run with `forgetful_args`);
        with `keep` (a file saved by `remember`), each holds that saved prefix instead."""
        for slot in range(slots):
            await slot_action(server_root(self.api_base), slot, "erase" if keep is None else "restore", 30.0, keep)

    async def remember(self, prompt: list[int], filename: str) -> None:
        """Evaluate `prompt` (token ids) in slot 0 and save it as `filename`, for `forget(keep=)`."""
        root = server_root(self.api_base)
        await erase_slot(root, 0, 30.0)
        async with httpx.AsyncClient(timeout=600.0) as client:
            response = await client.post(f"{root}/completion", json={"prompt": prompt, "n_predict": 1, "id_slot": 0,
                                                                     "cache_prompt": True, "temperature": 0})
            response.raise_for_status()
        await slot_action(root, 0, "save", 60.0, filename)

    def log_tail(self) -> str:
        lines = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    @property
    def pid(self) -> int:
        return self._process.pid

    def _terminate(self) -> None:
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def stop(self) -> None:
        """Stop the child for good (cancel `supervise` first)."""
        self._terminate()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the gateway dies without stopping it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
