"""Soak: a gateway under steady mixed load, with its upstream and its Redis killed underneath it.

Run: .venv/bin/python -m bench.soak [--minutes 10] [--clients 16] [--upstream-model qwen2.5-coder-0.5b-instruct]
                                    [--budget-tokens 4000] [--json PATH]

It starts a private redis-server (append-only with fsync always, on a free port, in a temporary
directory, so a restart keeps the ledger) and a gateway process (`python -m gateway serve`) with
SmolLM2 local, a llama-server upstream child the gateway launches itself, the Redis store under
a fresh key prefix, and two tenants with `rate_limits.max_parallel`: "open" (no budget) and
"capped" (a small daily budget of upstream tokens, `on_budget_exhausted: local`). N clients send
routed chat completions for the whole run, streaming and not, on varied short prompts with 16-48
answer tokens; a quarter of the requests are abandoned mid-answer (a stream closed after a few
chunks, or a 0.3 s read time-out). At a third of the run the upstream child is SIGKILLed; at two
thirds Redis is SIGKILLed and, 2 s later, started again on the same port. When every request has
ended it checks (the targets):

0. exercised: the upstream child was killed, Redis restarted, and the upstream billed tokens;
1. errors: no response other than 200, 429 and 503, no failed transfer, no mid-stream SSE error;
2. memory: the gateway's RSS grows < 5% over the last half of the run;
3. ledger: both tenants' day usage sums to the gateway's gateway_upstream_*_tokens_total counters;
4. reservations: every `<prefix>:held:<tenant>` zset is empty, /health/ready has no unsettled usage;
5. parallel slots: every `<prefix>:par:<tenant>` zset is empty;
6. budget: the capped tenant's usage passes its limit by at most one hand-off;

prints a table, writes a JSON summary with --json, and exits 1 if a check failed. Logs and Redis
files stay in the printed work directory. tests/test_soak.py runs the same soak for a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from adapters.upstream_server import free_port
from tests.conftest import wait_http  # one readiness poll for tests and benchmarks

ROOT = Path(__file__).resolve().parent.parent
LOCAL_MODEL = "smollm2-135m-instruct"
ALIAS = "routed"
OPEN, CAPPED = "open", "capped"
TENANTS = (OPEN, CAPPED)
CHAT = "/v1/chat/completions"
OK, ABANDONED, REFUSED, ERROR = "ok", "abandoned", "refused", "error"
REFUSAL_STATUSES = (429, 503)  # documented: rate limit / quota, local model busy
REQUEST_TIMEOUT = httpx.Timeout(120.0, connect=10.0)
ABANDON_TIMEOUT = httpx.Timeout(10.0, read=0.3)  # shorter than any answer: the client gives up
MEMORY_GROWTH_TARGET = 0.05
MEMORY_CHECK = "2 memory"

TASKS = ("Write one sentence about", "List three facts about", "Describe in a few words", "Give a short tip about",
         "Write a haiku about", "Explain to a child what you know about", "Say something surprising about",
         "Write a two-line poem about")
SUBJECTS = ("the sea", "volcanoes", "bread", "the moon", "bicycles", "honey bees", "Paris", "rain", "chess",
            "coffee", "glaciers", "owls", "the piano", "copper", "tea", "deserts", "trains", "tomatoes",
            "lighthouses", "snow", "maps", "clocks", "bridges", "salt")


@dataclass(frozen=True)
class SoakParams:
    duration_s: float = 600.0
    clients: int = 16
    upstream_model: str = "qwen2.5-coder-0.5b-instruct"
    budget_tokens: int = 4000  # the capped tenant's daily upstream_tokens
    max_parallel: int = 12
    abandon_share: float = 0.25
    min_tokens: int = 16
    max_tokens: int = 48
    threshold: float = 3.0  # entropy (nats) above which a step goes upstream (as in config.yaml)
    span: int = 4  # tokens the upstream writes per hand-off
    sample_every_s: float = 5.0
    redis_down_s: float = 2.0  # how long Redis stays down before it is started again
    seed: int = 0


# -- processes --

class PrivateRedis:
    """A redis-server of our own on a free port that keeps its data across a SIGKILL (AOF, fsync always)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = workdir / "redis"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._log = (workdir / "redis.log").open("ab")
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, decode_responses=True)
        self._process = self._start()

    def _start(self) -> subprocess.Popen:
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not installed")
        command = [server, "--port", str(self.port), "--bind", "127.0.0.1", "--appendonly", "yes",
                   "--appendfsync", "always", "--save", "", "--dir", str(self._dir)]
        process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if self.client.ping():
                    return process
            except redis.RedisError:  # not listening yet, or still loading the AOF
                time.sleep(0.05)
        process.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer")

    def restart(self, down_s: float) -> float:
        """SIGKILL, stay down `down_s`, start again on the same port and directory; returns the seconds it was down."""
        started = time.monotonic()
        self._process.kill()
        self._process.wait()
        time.sleep(down_s)
        self._process = self._start()
        return time.monotonic() - started

    def close(self) -> None:
        self.client.close()
        stop(self._process)
        self._log.close()

    def __enter__(self) -> "PrivateRedis":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class GatewayProcess:
    """`python -m gateway serve` on a config file of its own; its log goes to a file."""

    def __init__(self, config: dict[str, Any], workdir: Path, env: dict[str, str]) -> None:
        self.base_url = f"http://127.0.0.1:{config['server']['port']}"
        path = workdir / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "gateway.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=ROOT,
                                        env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(timeout_s=300)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        try:
            wait_http(f"{self.base_url}/health/ready", self.process, timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; see {self.log_path}") from exc

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS for the gateway process")

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

    def __enter__(self) -> "GatewayProcess":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def stop(process: subprocess.Popen, grace_s: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def gateway_config(params: SoakParams, redis_url: str, prefix: str) -> dict[str, Any]:
    """SmolLM2 local, a launched upstream in completions mode, the Redis store, two tenants."""
    def tenant(tenant_id: str, budget: int | None) -> dict[str, Any]:
        settings: dict[str, Any] = {"id": tenant_id, "api_key_env": key_env(tenant_id),
                                    "rate_limits": {"max_parallel": params.max_parallel}}
        if budget is not None:
            settings.update(daily={"upstream_tokens": budget}, on_budget_exhausted="local")
        return settings

    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "public_metrics": True},  # scraped from loopback
        "models": {"local": {"smol": {"gguf": LOCAL_MODEL, "n_ctx": 2048, "n_threads": 1}}},
        "upstreams": {"up": {
            "model": "text-completion-openai/up", "mode": "completions",
            "launch": {"gguf": params.upstream_model, "n_threads": 1, "n_ctx": 2048},
            "extra_body": {"repeat_penalty": 1.0}, "input_usd_per_mtok": 0.5, "output_usd_per_mtok": 1.5,
            "timeout_s": 10, "retries": 0, "breaker_cooldown_s": 2,
        }},
        "aliases": {ALIAS: {"local": "smol", "upstream": "up",
                            "routing": {"policy": "entropy", "threshold": params.threshold, "span": params.span}}},
        "store": {"backend": "redis", "url": redis_url, "key_prefix": prefix},
        "tenants": [tenant(OPEN, None), tenant(CAPPED, params.budget_tokens)],
        "admin_key_env": "SOAK_ADMIN_KEY",
    }


def key_env(tenant_id: str) -> str:
    return f"SOAK_{tenant_id.upper()}_KEY"


# -- load --

@dataclass(frozen=True)
class Plan:
    """One request a client is about to send."""

    tenant: str
    body: dict[str, Any]
    abandon: bool
    chunks_before_close: int  # streaming and abandon: chunks read before closing the connection


@dataclass(frozen=True)
class Outcome:
    tenant: str
    stream: bool
    kind: str  # ok | abandoned | refused | error
    status: int | None  # HTTP status; None when no response came
    routing: dict[str, Any] | None = None  # usage.routing of a completed answer
    retry_after_s: float = 0.0
    detail: str = ""


def next_plan(rng: random.Random, params: SoakParams, tenant: str) -> Plan:
    stream = rng.random() < 0.5
    temperature = rng.choice((0.0, 0.7))  # greedy answers may come from the continuation cache
    body: dict[str, Any] = {
        "model": ALIAS, "stream": stream, "temperature": temperature,
        "messages": [{"role": "user", "content": f"{rng.choice(TASKS)} {rng.choice(SUBJECTS)}."}],
        "max_tokens": rng.randint(params.min_tokens, params.max_tokens),
    }
    if temperature:
        body["seed"] = rng.randrange(10**6)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return Plan(tenant, body, rng.random() < params.abandon_share, rng.randint(2, 4))


async def send(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    stream = plan.body["stream"]
    try:
        return await (send_streaming(client, plan) if stream else send_plain(client, plan))
    except httpx.ReadTimeout:
        if plan.abandon and not stream:
            return Outcome(plan.tenant, stream, ABANDONED, None)
        return Outcome(plan.tenant, stream, ERROR, None, detail="ReadTimeout")
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not JSON
        return Outcome(plan.tenant, stream, ERROR, None, detail=f"{type(exc).__name__}: {exc}"[:200])


async def send_plain(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    timeout = ABANDON_TIMEOUT if plan.abandon else REQUEST_TIMEOUT
    response = await client.post(CHAT, json=plan.body, timeout=timeout)
    if response.status_code != 200:
        return not_ok(plan, response)
    body = response.json()
    routing = (body.get("usage") or {}).get("routing")
    if not body.get("choices") or routing is None:
        return Outcome(plan.tenant, False, ERROR, 200, detail="200 without choices or usage.routing")
    return Outcome(plan.tenant, False, OK, 200, routing)


async def send_streaming(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    async with client.stream("POST", CHAT, json=plan.body, timeout=REQUEST_TIMEOUT) as response:
        if response.status_code != 200:
            await response.aread()
            return not_ok(plan, response)
        return await read_events(plan, response)  # leaving early closes the connection


async def read_events(plan: Plan, response: httpx.Response) -> Outcome:
    chunks, routing = 0, None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            if routing is None:
                return Outcome(plan.tenant, True, ERROR, 200, detail="stream without a usage chunk")
            return Outcome(plan.tenant, True, OK, 200, routing)
        event = json.loads(data)
        if "error" in event:
            return Outcome(plan.tenant, True, ERROR, 200, detail=f"SSE error: {event['error'].get('message')}")
        if event.get("usage"):
            routing = event["usage"].get("routing")
            continue
        chunks += 1
        if plan.abandon and chunks >= plan.chunks_before_close:
            return Outcome(plan.tenant, True, ABANDONED, 200)
    return Outcome(plan.tenant, True, ERROR, 200, detail="stream ended without [DONE]")


def not_ok(plan: Plan, response: httpx.Response) -> Outcome:
    stream = plan.body["stream"]
    if response.status_code in REFUSAL_STATUSES:
        retry_after = float(response.headers.get("retry-after", "1"))
        return Outcome(plan.tenant, stream, REFUSED, response.status_code, retry_after_s=retry_after)
    return Outcome(plan.tenant, stream, ERROR, response.status_code, detail=response.text[:200])


async def client_loop(index: int, params: SoakParams, base_url: str, tenant: str, key: str,
                      deadline: float, outcomes: list[Outcome]) -> None:
    """One client: requests back to back until the deadline, pausing briefly after a refusal or an error."""
    rng = random.Random(params.seed * 1000 + index)
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < deadline:
            outcome = await send(client, next_plan(rng, params, tenant))
            outcomes.append(outcome)
            if outcome.kind in (REFUSED, ERROR):
                await asyncio.sleep(min(outcome.retry_after_s or 0.5, 1.0) * rng.uniform(0.5, 1.0))


# -- what happens underneath --

@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_kb: int
    upstream_pid: int | None


@dataclass
class Faults:
    upstream_killed_pid: int | None = None
    upstream_killed_at_s: float | None = None
    redis_restarted_at_s: float | None = None
    redis_down_s: float | None = None


async def sample_gateway(gateway: GatewayProcess, started: float, deadline: float, every_s: float,
                         outcomes: list[Outcome]) -> list[Sample]:
    """RSS and upstream child every `every_s` until the deadline, with a progress line on stderr."""
    samples = []
    while gateway.process.poll() is None:
        now = time.monotonic()
        sample = Sample(round(now - started, 1), gateway.rss_kb(), gateway.upstream_pid())
        samples.append(sample)
        print(f"[soak] {sample.t_s:5.0f} s  RSS {sample.rss_kb / 1024:6.1f} MB  upstream pid {sample.upstream_pid}  "
              f"{len(outcomes)} requests ended", file=sys.stderr, flush=True)
        if now >= deadline:
            break
        await asyncio.sleep(min(every_s, deadline - now))
    return samples


async def inject_faults(gateway: GatewayProcess, store: PrivateRedis, params: SoakParams, started: float) -> Faults:
    faults = Faults()
    await asyncio.sleep(max(0.0, started + params.duration_s / 3 - time.monotonic()))
    faults.upstream_killed_pid = gateway.upstream_pid()
    faults.upstream_killed_at_s = round(time.monotonic() - started, 1)
    if faults.upstream_killed_pid is not None:
        os.kill(faults.upstream_killed_pid, signal.SIGKILL)
    await asyncio.sleep(max(0.0, started + 2 * params.duration_s / 3 - time.monotonic()))
    faults.redis_restarted_at_s = round(time.monotonic() - started, 1)
    faults.redis_down_s = round(await asyncio.to_thread(store.restart, params.redis_down_s), 2)
    return faults


@dataclass
class Load:
    outcomes: list[Outcome]
    samples: list[Sample]
    faults: Faults
    seconds: float


async def run_load(params: SoakParams, gateway: GatewayProcess, store: PrivateRedis, keys: dict[str, str]) -> Load:
    started = time.monotonic()
    deadline = started + params.duration_s
    outcomes: list[Outcome] = []
    tenants = [TENANTS[i % len(TENANTS)] for i in range(params.clients)]
    clients = [client_loop(i, params, gateway.base_url, tenant, keys[tenant], deadline, outcomes)
               for i, tenant in enumerate(tenants)]
    *_, samples, faults = await asyncio.gather(
        *clients, sample_gateway(gateway, started, deadline, params.sample_every_s, outcomes),
        inject_faults(gateway, store, params, started))
    return Load(outcomes, samples, faults, time.monotonic() - started)


# -- after the load --

def metric_total(text: str, name: str) -> float:
    """The sum of a Prometheus metric over its label sets."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(gateway: GatewayProcess) -> str:
    return httpx.get(f"{gateway.base_url}/metrics", timeout=10).text


def wait_requests_ended(gateway: GatewayProcess, sent: int, timeout_s: float = 90) -> int:
    """Wait until the gateway has finished as many chat requests as were sent (an abandoned
    non-streaming request runs to its end); returns how many it counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        counted = int(metric_total(scrape(gateway), "gateway_chat_requests_total"))
        if counted >= sent or time.monotonic() >= deadline:
            return counted
        time.sleep(0.5)


def wait_unsettled_flushed(gateway: GatewayProcess, timeout_s: float = 15) -> int:
    """/health/ready's unsettled_usage once it is 0, or when the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        unsettled = httpx.get(f"{gateway.base_url}/health/ready", timeout=5).json()["unsettled_usage"]
        if unsettled == 0 or time.monotonic() >= deadline:
            return unsettled
        time.sleep(0.5)


def zset_sizes(client: redis.Redis, pattern: str) -> dict[str, int]:
    return {key: client.zcard(key) for key in client.scan_iter(match=pattern)}


def leftovers(client: redis.Redis, pattern: str, timeout_s: float) -> dict[str, list[str]]:
    """Members of the non-empty zsets matching `pattern` (with seconds to expiry), polling until
    they are all empty or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        sizes = zset_sizes(client, pattern)
        if not any(sizes.values()) or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    now = time.time()
    return {key: [f"{member} (expires in {score - now:.0f}s)" for member, score in client.zrange(key, 0, -1, withscores=True)]
            for key, size in sizes.items() if size}


def day_usage(gateway: GatewayProcess, admin_key: str, tenant: str) -> int:
    """The tenant's billed upstream tokens today, from the admin endpoint (retried while the store recovers)."""
    deadline = time.monotonic() + 10
    while True:
        response = httpx.get(f"{gateway.base_url}/admin/tenants/{tenant}/usage",
                             headers={"Authorization": f"Bearer {admin_key}"}, timeout=10)
        if response.status_code == 200:
            day = next(w for w in response.json()["windows"] if w["period"] == "day")
            return day["upstream_prompt_tokens"] + day["upstream_completion_tokens"]
        if time.monotonic() >= deadline:
            raise RuntimeError(f"usage of tenant {tenant}: {response.status_code} {response.text[:200]}")
        time.sleep(0.5)


@dataclass
class Books:
    """The gateway's state once the load has ended."""

    sent: int
    counted_by_gateway: int
    ledger: dict[str, int]  # tenant -> day usage
    metered: int  # gateway_upstream_prompt_tokens_total + gateway_upstream_completion_tokens_total
    unsettled: int
    held: dict[str, list[str]]  # non-empty <prefix>:held:* zsets
    parallel: dict[str, list[str]]  # non-empty <prefix>:par:* zsets
    logged_errors: list[str]


def read_books(gateway: GatewayProcess, store: PrivateRedis, prefix: str, admin_key: str, sent: int) -> Books:
    if gateway.process.poll() is not None:
        raise RuntimeError(f"the gateway exited with {gateway.process.returncode} during the soak; see {gateway.log_path}")
    counted = wait_requests_ended(gateway, sent)
    unsettled = wait_unsettled_flushed(gateway)
    parallel = leftovers(store.client, f"{prefix}:par:*", timeout_s=3)
    held = leftovers(store.client, f"{prefix}:held:*", timeout_s=0)
    metrics = scrape(gateway)
    metered = metric_total(metrics, "gateway_upstream_prompt_tokens_total") + metric_total(
        metrics, "gateway_upstream_completion_tokens_total")
    ledger = {tenant: day_usage(gateway, admin_key, tenant) for tenant in TENANTS}
    return Books(sent, counted, ledger, round(metered), unsettled, held, parallel, gateway.logged_errors())


# -- report --

@dataclass(frozen=True)
class Check:
    name: str
    target: str
    measured: str
    passed: bool


@dataclass
class Report:
    params: dict[str, Any]
    workdir: str
    seconds: float
    requests: dict[str, int]  # by kind and by stream/plain
    statuses: dict[str, int]  # by HTTP status ("none": no response)
    errors: dict[str, int]  # by detail
    degraded: dict[str, int]  # usage.routing.degraded reasons of completed answers
    samples: list[Sample]
    faults: Faults
    upstream_back_at_s: float | None  # when a new upstream child was first seen after the kill
    completed_tokens: int  # usage.routing upstream prompt+completion over completed answers
    handoff_bound: int
    books: Books
    checks: list[Check] = field(default_factory=list)


def billed(routing: dict[str, Any]) -> int:
    return routing["upstream_prompt_tokens"] + routing["upstream_completion_tokens"]


def handoff_bound(completed: list[dict[str, Any]], params: SoakParams) -> int:
    """Billed tokens one hand-off can reach: its prompt (the largest mean prompt per call of a
    completed answer, plus max_tokens for the answer so far) and a span."""
    per_call = [math.ceil(r["upstream_prompt_tokens"] / r["upstream_calls"]) for r in completed if r["upstream_calls"]]
    return max(per_call, default=0) + params.max_tokens + params.span


def memory_window(samples: list[Sample], duration_s: float) -> tuple[Sample, Sample] | None:
    """The first sample of the run's last half and the last sample."""
    late = [s for s in samples if s.t_s >= duration_s / 2]
    return (late[0], late[-1]) if len(late) >= 2 else None


def upstream_back_at(samples: list[Sample], faults: Faults) -> float | None:
    if faults.upstream_killed_at_s is None:
        return None
    return next((s.t_s for s in samples if s.t_s > faults.upstream_killed_at_s
                 and s.upstream_pid not in (None, faults.upstream_killed_pid)), None)


def summarize(params: SoakParams, workdir: Path, load: Load, books: Books) -> Report:
    outcomes = load.outcomes
    completed = [o.routing for o in outcomes if o.routing is not None]
    requests = Counter(o.kind for o in outcomes)
    requests.update(("stream" if o.stream else "plain") for o in outcomes)
    report = Report(
        params=dataclasses.asdict(params), workdir=str(workdir), seconds=round(load.seconds, 1),
        requests={"total": len(outcomes), **requests},
        statuses=dict(Counter(str(o.status or "none") for o in outcomes)),
        errors=dict(Counter(o.detail for o in outcomes if o.kind == ERROR).most_common()),
        degraded=dict(Counter(reason for r in completed for reason in r["degraded"])),
        samples=load.samples, faults=load.faults, upstream_back_at_s=upstream_back_at(load.samples, load.faults),
        completed_tokens=sum(billed(r) for r in completed), handoff_bound=handoff_bound(completed, params),
        books=books,
    )
    report.checks = checks(report, params)
    return report


def checks(report: Report, params: SoakParams) -> list[Check]:
    books, faults = report.books, report.faults
    ledger = sum(books.ledger.values())
    errors = report.requests.get(ERROR, 0)
    growth = memory_window(report.samples, params.duration_s)
    capped = books.ledger[CAPPED]
    exercised = faults.upstream_killed_pid is not None and faults.redis_down_s is not None and books.metered > 0
    return [
        Check("0 exercised", "upstream killed, Redis restarted, tokens billed",
              f"upstream pid {faults.upstream_killed_pid}, Redis down {faults.redis_down_s}s, "
              f"{books.metered} tokens", exercised),
        Check("1 errors", "0 (besides 429/503 and own disconnects)",
              f"{errors} of {report.requests['total']}", errors == 0),
        Check(MEMORY_CHECK, f"RSS growth < {MEMORY_GROWTH_TARGET:.0%} over the last half",
              "too few samples" if growth is None else
              f"{growth[0].rss_kb / 1024:.1f} -> {growth[1].rss_kb / 1024:.1f} MB "
              f"({growth[1].rss_kb / growth[0].rss_kb - 1:+.1%})",
              growth is not None and growth[1].rss_kb < growth[0].rss_kb * (1 + MEMORY_GROWTH_TARGET)),
        Check("3 ledger", "ledger == /metrics >= completed answers",
              f"ledger {ledger}, /metrics {books.metered}, completed {report.completed_tokens}",
              ledger == books.metered >= report.completed_tokens),
        Check("4 reservations", "0 held, 0 unsettled",
              f"{sum(map(len, books.held.values()))} held, {books.unsettled} unsettled",
              not books.held and books.unsettled == 0),
        Check("5 parallel slots", "0 held",
              f"{sum(map(len, books.parallel.values()))} held", not books.parallel),
        Check("6 budget", f"capped <= {params.budget_tokens} + one hand-off ({report.handoff_bound})",
              f"{capped} (overshoot {capped - params.budget_tokens:+d})",
              capped <= params.budget_tokens + report.handoff_bound),
    ]


def print_report(report: Report) -> None:
    p, r, books, faults = report.params, report.requests, report.books, report.faults
    print(f"soak: {report.seconds:.0f} s, {p['clients']} clients, upstream {p['upstream_model']}, "
          f"capped budget {p['budget_tokens']} tokens; work directory {report.workdir}")
    print(f"requests  {r['total']} sent: {r.get(OK, 0)} ok, {r.get(ABANDONED, 0)} abandoned, "
          f"{r.get(REFUSED, 0)} refused, {r.get(ERROR, 0)} errors ({r.get('stream', 0)} streaming, "
          f"{r.get('plain', 0)} not); the gateway counted {books.counted_by_gateway}")
    print(f"statuses  {', '.join(f'{k}: {v}' for k, v in sorted(report.statuses.items()))}")
    print(f"degraded  {', '.join(f'{k}: {v}' for k, v in report.degraded.items()) or 'none'}")
    back = "not seen again" if report.upstream_back_at_s is None else f"a new child at {report.upstream_back_at_s} s"
    print(f"faults    upstream pid {faults.upstream_killed_pid} SIGKILLed at {faults.upstream_killed_at_s} s ({back}); "
          f"Redis SIGKILLed at {faults.redis_restarted_at_s} s, down {faults.redis_down_s} s")
    print(f"memory    RSS MB at t(s): {', '.join(f'{s.t_s:.0f}:{s.rss_kb / 1024:.0f}' for s in report.samples)}")
    print(f"ledger    {', '.join(f'{t} {n}' for t, n in books.ledger.items())}; /metrics {books.metered}; "
          f"completed answers {report.completed_tokens}")
    for detail, count in list(report.errors.items())[:5]:
        print(f"error     {count} x {detail}")
    for key, members in {**books.held, **books.parallel}.items():
        print(f"left      {key}: {len(members)}, e.g. {'; '.join(members[:3])}")
    if books.logged_errors:
        print(f"gateway   {len(books.logged_errors)} error log lines, e.g. {books.logged_errors[0][:200]}")
    print(f"\n{'check':18s} {'target':48s} {'measured':56s} result")
    for check in report.checks:
        print(f"{check.name:18s} {check.target:48s} {check.measured:56s} {'PASS' if check.passed else 'FAIL'}")


# -- the whole soak --

def run_soak(params: SoakParams, workdir: Path) -> Report:
    """Start Redis and the gateway, run the load with its faults, read the books, stop everything."""
    keys = {tenant: f"sk-soak-{tenant}-{secrets.token_hex(8)}" for tenant in TENANTS}
    admin_key = f"sk-soak-admin-{secrets.token_hex(8)}"
    env = {**{key_env(t): k for t, k in keys.items()}, "SOAK_ADMIN_KEY": admin_key}
    prefix = f"soak-{uuid.uuid4().hex[:8]}"
    with PrivateRedis(workdir) as store:
        with GatewayProcess(gateway_config(params, store.url, prefix), workdir, env) as gateway:
            load = asyncio.run(run_load(params, gateway, store, keys))
            books = read_books(gateway, store, prefix, admin_key, len(load.outcomes))
    return summarize(params, workdir, load, books)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--upstream-model", default=SoakParams.upstream_model,
                        help="catalog name or GGUF path of the launched upstream")
    parser.add_argument("--budget-tokens", type=int, default=SoakParams.budget_tokens,
                        help="daily upstream_tokens of the capped tenant")
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args()
    params = SoakParams(duration_s=args.minutes * 60, clients=args.clients, upstream_model=args.upstream_model,
                        budget_tokens=args.budget_tokens)
    report = run_soak(params, Path(tempfile.mkdtemp(prefix="soak-")))
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=2))
    return 0 if all(check.passed for check in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
