"""The processes bench/soak.py runs and kills: a private Redis or a private 3-node Redis Cluster
(both append-only with fsync always, so a SIGKILLed node keeps its data), a shared llama-server
upstream (tenant slots, restartable on its port), and gateway replicas (`python -m gateway serve`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml
from redis.cluster import RedisCluster

from adapters.model_files import resolve_model
from adapters.upstream_server import forgetful_args, free_port, server_command, server_root
from bench.support import cluster_port, wait_http
from gateway.settings import LaunchSettings

ROOT = Path(__file__).resolve().parent.parent


def stop(process: subprocess.Popen, grace_s: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def redis_server(port: int, directory: Path, log, *extra: str) -> subprocess.Popen:
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("redis-server is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    command = [server, "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes", "--appendfsync", "always",
               "--save", "", "--dir", str(directory), *extra]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def wait_ping(client: redis.Redis, process: subprocess.Popen, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if client.ping():
                return
        except redis.RedisError:  # not listening yet, or still loading the AOF
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{what} did not answer")


class PrivateRedis:
    """A redis-server of our own on a free port that keeps its data across a SIGKILL (AOF, fsync always)."""

    cluster = False

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = workdir / "redis"
        self._log = (workdir / "redis.log").open("ab")
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, decode_responses=True)
        self._process = self._start()

    def _start(self) -> subprocess.Popen:
        process = redis_server(self.port, self._dir, self._log)
        wait_ping(self.client, process, f"redis-server on port {self.port}")
        return process

    def restart(self, down_s: float, prefix: str) -> tuple[float, str]:
        """SIGKILL, stay down `down_s`, start again on the same port and directory; returns the
        seconds it was down and what was killed."""
        started = time.monotonic()
        self._process.kill()
        self._process.wait()
        time.sleep(down_s)
        self._process = self._start()
        return time.monotonic() - started, f"redis-server :{self.port} (every key)"

    def close(self) -> None:
        self.client.close()
        stop(self._process)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class PrivateCluster:
    """Three Redis Cluster masters on loopback (no replicas), each append-only with fsync always
    in a directory of its own, made with `redis-cli --cluster create` as tests/conftest.py does."""

    cluster = True

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir / "cluster"
        self.ports = [cluster_port() for _ in range(3)]
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"
        self._log = (workdir / "cluster.log").open("ab")
        self._processes = {port: self._start(port) for port in self.ports}
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self._wait_ok()
        self.client = RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=2, decode_responses=True)

    def _start(self, port: int) -> subprocess.Popen:
        directory = self._workdir / str(port)
        process = redis_server(port, directory, self._log, "--cluster-enabled", "yes",
                               "--cluster-config-file", str(directory / "nodes.conf"))
        wait_ping(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1), process, f"cluster node :{port}")
        return process

    def _wait_ok(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for port in self.ports:
                try:
                    states.append(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).cluster("info")
                                  .get("cluster_state"))
                except redis.RedisError:
                    states.append(None)
            if all(state == "ok" for state in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster is not ok: {states}")
            time.sleep(0.2)

    def port_of(self, key: str) -> int:
        return self.client.get_node_from_key(key).port

    def restart(self, down_s: float, prefix: str) -> tuple[float, str]:
        """SIGKILL the node that holds the capped tenant's keys, start it again after `down_s`
        (same port, nodes.conf and AOF); returns the seconds until the cluster was ok again and
        which node (and which hash tags) went down."""
        tags = {tag: self.port_of(f"{prefix}:{{{tag}}}:x") for tag in ("open", "capped", "rpm", "cache:")}
        port = tags["capped"]
        held = ", ".join(f"{{{tag}}}" for tag, p in tags.items() if p == port)
        started = time.monotonic()
        self._processes[port].kill()
        self._processes[port].wait()
        time.sleep(down_s)
        self._processes[port] = self._start(port)
        self._wait_ok()
        return time.monotonic() - started, f"cluster node :{port} holding {held}"

    def close(self) -> None:
        self.client.close()
        for process in self._processes.values():
            stop(process)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class SharedUpstream:
    """One llama-server every replica calls (tenant-isolated slots: --cache-ram 0, --slot-save-path),
    started by the soak, SIGKILLed and started again on the same port by it."""

    def __init__(self, model: str, slots: int, threads: int, workdir: Path, alias: str = "up") -> None:
        self.port = free_port()
        self.api_base = f"http://127.0.0.1:{self.port}/v1"
        self.slots = slots
        launch = LaunchSettings(gguf=model, n_threads=threads, n_ctx=2048, parallel=slots)
        self._command = server_command(resolve_model(model), launch, self.port, alias) + forgetful_args()
        self._log = (workdir / "upstream.log").open("ab")
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen(self._command, stdout=self._log, stderr=subprocess.STDOUT)
        wait_http(f"{self.api_base}/models", process, 120)
        return process

    @property
    def server_id(self) -> str:
        """The name its slot leases go under in the store (as adapters/cache_isolation.py names it)."""
        return hashlib.sha256(server_root(self.api_base).encode("utf-8")).hexdigest()[:16]

    def restart(self, down_s: float) -> tuple[int, float]:
        """SIGKILL, wait `down_s`, start again; returns the killed pid and the seconds until it answered."""
        started, pid = time.monotonic(), self.process.pid
        self.process.kill()
        self.process.wait()
        time.sleep(down_s)
        self.process = self._start()
        return pid, time.monotonic() - started

    def close(self) -> None:
        stop(self.process)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class GatewayProcess:
    """`python -m gateway serve` on a config file of its own; its log goes to a file."""

    def __init__(self, config: dict[str, Any], workdir: Path, env: dict[str, str], name: str = "gateway") -> None:
        self.name = name
        self.base_url = f"http://127.0.0.1:{config['server']['port']}"
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT,
                                        env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300) -> None:
        try:
            wait_http(f"{self.base_url}/health/ready", self.process, timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; see {self.log_path}") from exc

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def rss_kb(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return None  # gone (or a zombie)

    def upstream_pid(self) -> int | None:
        """The pid of the gateway's live llama-server child, if it has one."""
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                stat = (proc / "stat").read_text()
                cmdline = (proc / "cmdline").read_bytes()  # empty for a zombie
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == self.process.pid and b"llama-server" in cmdline:
                return int(proc.name)
        return None

    def scrape(self, admin_key: str, timeout_s: float = 10) -> str:
        return httpx.get(f"{self.base_url}/metrics", headers={"Authorization": f"Bearer {admin_key}"},
                         timeout=timeout_s).text

    def logged_errors(self) -> list[str]:
        """Messages of the JSON log lines at level error or critical."""
        messages = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("level") in ("error", "critical"):
                messages.append(str(record.get("msg")))
        return messages

    def close(self) -> None:
        stop(self.process, grace_s=60)
        self._log.close()
