"""Soak: gateway replicas under steady mixed load, with their upstream, their store and one of them killed.

Run: .venv/bin/python -m bench.soak [--minutes 10] [--clients 16] [--rpm 60] [--replicas 1] [--cluster] [--kill-replica]
                                    [--upstream-model qwen2.5-coder-0.5b-instruct] [--budget-tokens 4000]
                                    [--json PATH]

It starts the store: a private redis-server (append-only with fsync always, on a free port, in a
temporary directory, so a restart keeps the ledger), or with --cluster a private 3-node Redis
Cluster (three masters, each append-only in a directory of its own; gateways get `store.cluster:
true`). Then --replicas gateway processes (`python -m gateway serve`, loopback ports) with SmolLM2
local, the store under one fresh key prefix, and three tenants: "open" (no budget), "capped" (a
small daily budget of upstream tokens, `on_budget_exhausted: local`), both with
`rate_limits.max_parallel`, and "rpm" (`rate_limits.requests_per_minute: 60`; one-token requests
sent at 90 a minute, at most 6 at once, so that it asks for more than its limit). The upstream: with one replica, a llama-server child the gateway
launches itself (as before); with several, one shared llama-server the soak starts (tenant-isolated
slots, `kind: llama-server`, `--cache-ram 0 --slot-save-path`, its slots leased through the store):
on 2 cores one server batching every replica's hand-offs beats a child per replica, and it is the
layout several replicas are deployed in.

The clients send routed chat completions for the whole run, streaming and not, on varied short
prompts with 16-48 answer tokens, some (`agreement_share`) with an agreement check of their own
(3 answers each: a routing override, so their shadow answers are kept apart from the alias's); the
alias shadows a quarter of its answers on the operator's ledger (`shadow`, a daily budget of its own);
a quarter of the requests are abandoned mid-answer (a stream
closed after a few chunks, or a 0.3 s read time-out). The load generator is the load balancer:
requests go to the replicas round-robin, and one whose replica refuses the connection is sent once
more to the next replica (a fail-over). Faults: at a third of the run the upstream is SIGKILLed
(the launched child, which its gateway restarts; or the shared server, which the soak starts again
after 2 s); at half the run, with --kill-replica, the last replica is SIGKILLed for good (its
/metrics scraped just before); at two thirds Redis is SIGKILLed (with --cluster: the node holding
the capped tenant's keys) and, 2 s later, started again on the same port. When every request has
ended it checks (the targets):

0. exercised: the faults happened and the upstream billed tokens;
1. errors: no response other than 200, 429 and 503 (the local model's queue full: load shedding with
   Retry-After, printed with its count: a load this machine cannot serve, not a fault), no failed
   transfer, no mid-stream SSE error,
   except requests cut by the replica kill (in flight on it at that moment: no balancer can replay them);
2. memory: each surviving replica's RSS grows < 5% over the last half of the run;
3. ledger: all tenants' day usage == the sum over replicas of gateway_upstream_*_tokens_total; a
   killed replica counts with its last scrape (taken just before the kill), so the two may differ
   by the calls that ended between that scrape and the kill: the check allows that many hand-offs;
4. reservations: no live `{p}:{tenant}:held` reservation, no unsettled usage on any replica (a
   killed replica's reservations are counted apart: each must expire by itself within its TTL);
5. parallel slots: no `{p}:{tenant}:par` member, nor llama-server slot lease, held by a surviving
   replica (the killed one's in-flight requests leave theirs until they expire: at most one each);
6. budget: the capped tenant's usage passes its limit by at most one hand-off per replica;
7. rpm: at most 60 requests of the rpm tenant admitted in any calendar minute, as the store's rate
   keys count them (read every few seconds); client-side 200s per minute are printed beside (a store
   outage admits requests unmetered, by design: such minutes are marked);
8. shadow: shadow answers were compared (the alias's own, or overridden requests' kept apart), and
   the operator's shadow tokens pass its daily budget by at most one shadow call per replica;

prints a table, writes a JSON summary with --json, and exits 1 if a check failed. Logs and Redis
files stay in the printed work directory. tests/test_soak.py runs the one-replica soak for a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import secrets
import signal
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

from adapters.upstream_server import free_port
from bench.soak_processes import GatewayProcess, PrivateCluster, PrivateRedis, SharedUpstream

LOCAL_MODEL = "smollm2-135m-instruct"
ALIAS = "routed"
OPEN, CAPPED, RPM = "open", "capped", "rpm"
TENANTS = (OPEN, CAPPED, RPM)
SHADOW_OPERATOR = "shadow-operator"
CHAT = "/v1/chat/completions"
OK, ABANDONED, REFUSED, ERROR, CUT = "ok", "abandoned", "refused", "error", "cut"
REFUSAL_STATUSES = (429, 503)  # documented: rate limit / quota, local model busy
REQUEST_TIMEOUT = httpx.Timeout(120.0, connect=10.0)
ABANDON_TIMEOUT = httpx.Timeout(10.0, read=0.3)  # shorter than any answer: the client gives up
MEMORY_GROWTH_TARGET = 0.05
MEMORY_CHECK = "2 memory"
RESERVATION_TTL_S = 60.0  # store.reservation_ttl_s (the default); parallel slots live 10x that

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
    rpm: int = 60  # the rpm tenant's requests_per_minute
    rpm_sends_per_min: float = 90.0  # the rpm tenant's requests, sent at this pace (open loop), 1 token each
    rpm_in_flight: int = 6  # at most this many of them at once (the local queues hold 16 per replica)
    abandon_share: float = 0.25
    agreement_share: float = 0.15  # requests that bring their own agreement check (3 answers): a routing override
    shadow_rate: float = 0.25  # the alias's shadow answers (the operator's ledger, never a tenant's)
    shadow_budget_tokens: int = 3000  # the operator's daily shadow tokens
    min_tokens: int = 16
    max_tokens: int = 48
    threshold: float = 3.0  # entropy (nats) above which a step goes upstream (as in config.yaml)
    span: int = 4  # tokens the upstream writes per hand-off
    sample_every_s: float = 5.0
    redis_down_s: float = 2.0  # how long Redis (or a cluster node, or a shared upstream) stays down
    replicas: int = 1
    cluster: bool = False
    kill_replica: bool = False
    shared_slots: int = 4  # slots (--parallel) of the shared llama-server (several replicas)
    seed: int = 0


def gateway_config(params: SoakParams, store_url: str, prefix: str, upstream: SharedUpstream | None) -> dict[str, Any]:
    """SmolLM2 local, an upstream in completions mode (launched, or the shared server), the Redis store, three tenants."""
    def tenant(tenant_id: str) -> dict[str, Any]:
        settings: dict[str, Any] = {"id": tenant_id, "api_key_env": key_env(tenant_id)}
        if tenant_id == RPM:
            settings["rate_limits"] = {"requests_per_minute": params.rpm}
        else:
            settings["rate_limits"] = {"max_parallel": params.max_parallel}
        if tenant_id == CAPPED:
            settings.update(daily={"upstream_tokens": params.budget_tokens}, on_budget_exhausted="local")
        return settings

    up: dict[str, Any] = {
        "model": "text-completion-openai/up", "mode": "completions",
        "extra_body": {"repeat_penalty": 1.0}, "input_usd_per_mtok": 0.5, "output_usd_per_mtok": 1.5,
        "timeout_s": 10, "retries": 0, "breaker_cooldown_s": 2,
    }
    if upstream is None:
        up["launch"] = {"gguf": params.upstream_model, "n_threads": 1, "n_ctx": 2048}
    else:
        up.update(api_base=upstream.api_base, template_gguf=params.upstream_model, kind="llama-server",
                  slots=upstream.slots, cache_isolation="tenant")
    store: dict[str, Any] = {"backend": "redis", "url": store_url, "key_prefix": prefix}
    if params.cluster:
        store["cluster"] = True
    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "public_metrics": True},  # scraped from loopback
        "models": {"local": {"smol": {"gguf": LOCAL_MODEL, "n_ctx": 2048, "n_threads": 1}}},
        "upstreams": {"up": up},
        "aliases": {ALIAS: {"local": "smol", "upstream": "up",
                            "routing": {"policy": "entropy", "threshold": params.threshold, "span": params.span,
                                        "shadow": {"rate": params.shadow_rate}}}},
        "shadow": {"operator": SHADOW_OPERATOR, "daily": {"upstream_tokens": params.shadow_budget_tokens}},
        "store": store,
        "tenants": [tenant(t) for t in TENANTS],
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
    kind: str  # ok | abandoned | refused | error | cut
    status: int | None  # HTTP status; None when no response came
    routing: dict[str, Any] | None = None  # usage.routing of a completed answer
    retry_after_s: float = 0.0
    detail: str = ""
    replica: int = 0  # the replica that answered (after a fail-over: the second one)
    failover: bool = False
    sent_at: float = 0.0  # wall clock (time.time()) when sent
    ended_s: float = 0.0  # seconds into the run when it ended


def next_plan(rng: random.Random, params: SoakParams, tenant: str) -> Plan:
    stream = rng.random() < 0.5
    temperature = rng.choice((0.0, 0.7))  # greedy answers may come from the continuation cache
    short = tenant == RPM  # many quick requests: enough to reach its per-minute limit
    body: dict[str, Any] = {
        "model": ALIAS, "stream": stream, "temperature": temperature,
        "messages": [{"role": "user", "content": f"{rng.choice(TASKS)} {rng.choice(SUBJECTS)}."}],
        "max_tokens": 1 if short else rng.randint(params.min_tokens, params.max_tokens),
    }
    if temperature:
        body["seed"] = rng.randrange(10**6)
    if stream:
        body["stream_options"] = {"include_usage": True}
    if not short and rng.random() < params.agreement_share:
        body["routing"] = {"answer_check": {"kind": "agreement", "samples": 3, "format": "text"}}
    abandon = not short and rng.random() < params.abandon_share
    return Plan(tenant, body, abandon, rng.randint(2, 4))


class Balancer:
    """Round-robin over the replicas' base URLs; a refused connection is tried once on the next one."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self._next, self.failovers = urls, 0, 0

    def pick(self) -> int:
        index = self._next % len(self.urls)
        self._next += 1
        return index


async def send(client: httpx.AsyncClient, plan: Plan, balancer: Balancer) -> Outcome:
    replica, sent_at = balancer.pick(), time.time()
    try:
        outcome = await send_to(client, plan, balancer.urls[replica])
        failover = False
    except httpx.ConnectError:  # the replica is down: the balancer tries the next one, once
        balancer.failovers += 1
        replica, failover = (replica + 1) % len(balancer.urls), True
        try:
            outcome = await send_to(client, plan, balancer.urls[replica])
        except httpx.ConnectError as exc:
            outcome = Outcome(plan.tenant, plan.body["stream"], ERROR, None, detail=f"ConnectError twice: {exc}"[:200])
    return dataclasses.replace(outcome, replica=replica, failover=failover, sent_at=sent_at)


async def send_to(client: httpx.AsyncClient, plan: Plan, base_url: str) -> Outcome:
    """One request to one replica; a refused connection raises httpx.ConnectError."""
    stream = plan.body["stream"]
    url = f"{base_url}{CHAT}"
    try:
        return await (send_streaming(client, plan, url) if stream else send_plain(client, plan, url))
    except httpx.ConnectError:
        raise
    except httpx.ReadTimeout:
        if plan.abandon and not stream:
            return Outcome(plan.tenant, stream, ABANDONED, None)
        return Outcome(plan.tenant, stream, ERROR, None, detail="ReadTimeout")
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not JSON
        return Outcome(plan.tenant, stream, ERROR, None, detail=f"{type(exc).__name__}: {exc}"[:200])


async def send_plain(client: httpx.AsyncClient, plan: Plan, url: str) -> Outcome:
    timeout = ABANDON_TIMEOUT if plan.abandon else REQUEST_TIMEOUT
    response = await client.post(url, json=plan.body, timeout=timeout)
    if response.status_code != 200:
        return not_ok(plan, response)
    body = response.json()
    routing = (body.get("usage") or {}).get("routing")
    if not body.get("choices") or routing is None:
        return Outcome(plan.tenant, False, ERROR, 200, detail="200 without choices or usage.routing")
    return Outcome(plan.tenant, False, OK, 200, routing)


async def send_streaming(client: httpx.AsyncClient, plan: Plan, url: str) -> Outcome:
    async with client.stream("POST", url, json=plan.body, timeout=REQUEST_TIMEOUT) as response:
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


async def client_loop(index: int, params: SoakParams, balancer: Balancer, tenant: str, key: str, started: float,
                      deadline: float, outcomes: list[Outcome]) -> None:
    """One client: requests back to back until the deadline, pausing briefly after a refusal or an error."""
    rng = random.Random(params.seed * 1000 + index)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < deadline:
            outcome = await send(client, next_plan(rng, params, tenant), balancer)
            outcomes.append(dataclasses.replace(outcome, ended_s=round(time.monotonic() - started, 2)))
            if outcome.kind in (REFUSED, ERROR):
                await asyncio.sleep(min(outcome.retry_after_s or 0.5, 1.0) * rng.uniform(0.5, 1.0))


async def rpm_pacer(params: SoakParams, balancer: Balancer, key: str, started: float, deadline: float,
                    outcomes: list[Outcome]) -> None:
    """The rpm tenant: one-token requests at a steady pace above its limit (an open loop: a closed
    one waits on the busy local model and never asks for 60 a minute on 2 cores)."""
    rng = random.Random(params.seed * 1000 + 999)
    room = asyncio.Semaphore(params.rpm_in_flight)

    async def one(client: httpx.AsyncClient, plan: Plan) -> None:
        try:
            outcome = await send(client, plan, balancer)
            outcomes.append(dataclasses.replace(outcome, ended_s=round(time.monotonic() - started, 2)))
        finally:
            room.release()

    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as client:
        tasks = []
        while time.monotonic() < deadline:
            await room.acquire()
            plan = next_plan(rng, params, RPM)
            tasks.append(asyncio.create_task(one(client, plan)))
            await asyncio.sleep(60 / params.rpm_sends_per_min)
        await asyncio.gather(*tasks)


# -- what happens underneath --

@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_kb: list[int | None]  # per replica; None once it is gone
    upstream_pid: int | None


@dataclass
class Faults:
    upstream_killed_pid: int | None = None
    upstream_killed_at_s: float | None = None
    upstream_down_s: float | None = None  # the shared server: until the soak had it answering again
    replica_killed: int | None = None
    replica_killed_at_s: float | None = None
    replica_last_metered: int | None = None  # its upstream token counters, scraped just before the kill
    replica_last_requests: int | None = None  # its gateway_chat_requests_total then
    redis_restarted_at_s: float | None = None
    redis_down_s: float | None = None
    redis_killed: str | None = None  # which server or cluster node, and the hash tags it held


@dataclass
class Underneath:
    """What the sampler saw: RSS, the upstream, and the rpm tenant's admissions per minute."""

    samples: list[Sample] = field(default_factory=list)
    rpm_admitted: dict[int, int] = field(default_factory=dict)  # calendar minute -> the store's count
    store_misses: list[float] = field(default_factory=list)  # wall times when the store did not answer


class Soak:
    """The running pieces: store, upstream (shared or launched), replicas."""

    def __init__(self, params: SoakParams, store, upstream: SharedUpstream | None, gateways: list[GatewayProcess],
                 prefix: str, admin_key: str) -> None:
        self.params, self.store, self.upstream, self.gateways = params, store, upstream, gateways
        self.prefix, self.admin_key = prefix, admin_key

    def key(self, tenant: str, *parts: object) -> str:
        return ":".join((self.prefix, f"{{{tenant}}}", *map(str, parts)))

    def upstream_pid(self) -> int | None:
        if self.upstream is not None:
            return self.upstream.process.pid if self.upstream.process.poll() is None else None
        return self.gateways[0].upstream_pid()

    def alive(self) -> list[GatewayProcess]:
        return [g for g in self.gateways if g.alive]


async def sample(soak: Soak, started: float, deadline: float, outcomes: list[Outcome]) -> Underneath:
    """RSS per replica, the upstream pid and the rpm tenant's rate keys every few seconds until the
    deadline, with a progress line on stderr."""
    seen = Underneath()
    while soak.alive():
        now = time.monotonic()
        entry = Sample(round(now - started, 1), [g.rss_kb() if g.alive else None for g in soak.gateways],
                       soak.upstream_pid())
        seen.samples.append(entry)
        await asyncio.to_thread(read_rate_keys, soak, seen)
        rss = " ".join("-" if kb is None else f"{kb / 1024:.0f}" for kb in entry.rss_kb)
        print(f"[soak] {entry.t_s:5.0f} s  RSS MB {rss}  upstream pid {entry.upstream_pid}  "
              f"{len(outcomes)} requests ended", file=sys.stderr, flush=True)
        if now >= deadline:
            break
        await asyncio.sleep(min(soak.params.sample_every_s, deadline - now))
    return seen


def read_rate_keys(soak: Soak, seen: Underneath) -> None:
    """The rpm tenant's counts of this minute and the last (a minute's key lives 120 s after its last request)."""
    minute = int(time.time() // 60)
    try:
        for m in (minute - 1, minute):
            count = soak.store.client.hget(soak.key(RPM, "rate", m), "requests")
            if count is not None:
                seen.rpm_admitted[m] = max(seen.rpm_admitted.get(m, 0), int(count))
    except redis.RedisError:
        seen.store_misses.append(time.time())


async def inject_faults(soak: Soak, started: float) -> Faults:
    params, faults = soak.params, Faults()

    async def at(fraction: float) -> None:
        await asyncio.sleep(max(0.0, started + params.duration_s * fraction - time.monotonic()))

    await at(1 / 3)
    faults.upstream_killed_at_s = round(time.monotonic() - started, 1)
    if soak.upstream is not None:  # the shared server: the soak starts it again
        pid, down = await asyncio.to_thread(soak.upstream.restart, params.redis_down_s)
        faults.upstream_killed_pid, faults.upstream_down_s = pid, round(down, 2)
    else:  # the launched child: its gateway starts it again
        faults.upstream_killed_pid = soak.gateways[0].upstream_pid()
        if faults.upstream_killed_pid is not None:
            os.kill(faults.upstream_killed_pid, signal.SIGKILL)
    if params.kill_replica and len(soak.gateways) > 1:
        await at(1 / 2)
        victim = soak.gateways[-1]
        metrics = await asyncio.to_thread(victim.scrape, soak.admin_key)
        victim.process.kill()  # SIGKILL; never started again
        faults.replica_killed_at_s = round(time.monotonic() - started, 1)
        faults.replica_killed = len(soak.gateways) - 1
        faults.replica_last_metered = metered(metrics)
        faults.replica_last_requests = int(metric_total(metrics, "gateway_chat_requests_total"))
        await asyncio.to_thread(victim.process.wait)
    await at(2 / 3)
    faults.redis_restarted_at_s = round(time.monotonic() - started, 1)
    down, what = await asyncio.to_thread(soak.store.restart, params.redis_down_s, soak.prefix)
    faults.redis_down_s, faults.redis_killed = round(down, 2), what
    return faults


@dataclass
class Load:
    outcomes: list[Outcome]
    underneath: Underneath
    faults: Faults
    failovers: int
    seconds: float


async def run_load(soak: Soak, keys: dict[str, str]) -> Load:
    params = soak.params
    started = time.monotonic()
    deadline = started + params.duration_s
    outcomes: list[Outcome] = []
    balancer = Balancer([g.base_url for g in soak.gateways])
    tenants = [(OPEN, CAPPED)[i % 2] for i in range(params.clients)]
    clients = [client_loop(i, params, balancer, tenant, keys[tenant], started, deadline, outcomes)
               for i, tenant in enumerate(tenants)]
    clients.append(rpm_pacer(params, balancer, keys[RPM], started, deadline, outcomes))
    *_, underneath, faults = await asyncio.gather(*clients, sample(soak, started, deadline, outcomes),
                                                  inject_faults(soak, started))
    return Load(outcomes, underneath, faults, balancer.failovers, time.monotonic() - started)


# -- after the load --

def metric_total(text: str, name: str) -> float:
    """The sum of a Prometheus metric over its label sets."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metered(metrics: str) -> int:
    return round(metric_total(metrics, "gateway_upstream_prompt_tokens_total")
                 + metric_total(metrics, "gateway_upstream_completion_tokens_total"))


def wait_requests_ended(soak: Soak, gateway: GatewayProcess, sent: int, timeout_s: float = 90) -> int:
    """Wait until a replica has finished as many chat requests as were sent to it (an abandoned
    non-streaming request runs to its end); returns how many it counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        counted = int(metric_total(gateway.scrape(soak.admin_key), "gateway_chat_requests_total"))
        if counted >= sent or time.monotonic() >= deadline:
            return counted
        time.sleep(0.5)


def wait_unsettled_flushed(gateway: GatewayProcess, timeout_s: float = 15) -> int:
    """/health/ready's unsettled_usage once it and the queued releases are 0, or when the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = httpx.get(f"{gateway.base_url}/health/ready", timeout=5).json()
        if ready["unsettled_usage"] == ready["unreleased_holds"] == 0 or time.monotonic() >= deadline:
            return ready["unsettled_usage"]
        time.sleep(0.5)


def live_members(client, keys: list[str], timeout_s: float) -> dict[str, list[tuple[str, float]]]:
    """Unexpired members (score = expiry) of the zsets `keys`, polling until none is left or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = time.time()
        found = {key: [(m, s) for m, s in client.zrange(key, 0, -1, withscores=True) if s > now] for key in keys}
        found = {key: members for key, members in found.items() if members}
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


def slot_leases(soak: Soak) -> list[str]:
    """Slots of the shared llama-server whose lease has not run out."""
    if soak.upstream is None:
        return []
    states = soak.store.client.hgetall(soak.key(f"slots:{soak.upstream.server_id}", "state"))
    now = time.time()
    return [f"slot {slot} held {json.loads(raw).get('b', 0) - now:.0f}s more" for slot, raw in states.items()
            if json.loads(raw).get("b", 0) > now]


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


def shadow_books(gateway: GatewayProcess, admin_key: str) -> dict[str, Any]:
    """The operator's shadow tokens today and the alias's compared shadow answers (alias's own and
    overridden), from GET /admin/quality (retried while the store recovers)."""
    deadline = time.monotonic() + 10
    while True:
        response = httpx.get(f"{gateway.base_url}/admin/quality", headers={"Authorization": f"Bearer {admin_key}"},
                             timeout=10)
        if response.status_code == 200:
            quality = response.json()
            day = next(w for w in quality["operator"]["windows"] if w["period"] == "day")
            alias = next(a for a in quality["aliases"] if a["alias"] == ALIAS)
            return {"tokens": day["upstream_prompt_tokens"] + day["upstream_completion_tokens"],
                    "compared": alias["figures"]["samples"], "overridden": alias["overridden"]["figures"]["samples"]}
        if time.monotonic() >= deadline:
            raise RuntimeError(f"/admin/quality: {response.status_code} {response.text[:200]}")
        time.sleep(0.5)


@dataclass
class Books:
    """The replicas' and the store's state once the load has ended."""

    sent: int
    counted_by_gateways: int  # surviving replicas' gateway_chat_requests_total (+ the killed one's last scrape)
    ledger: dict[str, int]  # tenant -> day usage
    shadow: dict[str, Any]  # the operator's day usage and shadow calls compared, from /admin/quality
    metered: int  # sum over replicas of gateway_upstream_{prompt,completion}_tokens_total (killed: last scrape)
    metered_by_replica: list[int]
    unsettled: int
    held: dict[str, list[str]]  # live members of {p}:{tenant}:held zsets
    parallel: dict[str, list[str]]  # live members of {p}:{tenant}:par zsets
    slot_leases: list[str]  # the shared llama-server's slot leases still held
    expires_by_s: float  # the latest expiry (seconds from now) among those leftovers
    rpm_admitted: dict[int, int]  # calendar minute -> the store's count, with the last minutes read now
    logged_errors: list[str]


def read_books(soak: Soak, load: Load) -> Books:
    killed = load.faults.replica_killed
    for index, gateway in enumerate(soak.gateways):
        if index != killed and not gateway.alive:
            raise RuntimeError(f"replica {index} exited with {gateway.process.returncode} during the soak; "
                               f"see {gateway.log_path}")
    survivors = [(i, g) for i, g in enumerate(soak.gateways) if i != killed]
    counted = sum(wait_requests_ended(soak, g, sum(o.replica == i for o in load.outcomes)) for i, g in survivors)
    unsettled = sum(wait_unsettled_flushed(g) for _, g in survivors)
    client = soak.store.client
    parallel = live_members(client, [soak.key(t, "par") for t in (OPEN, CAPPED)], timeout_s=3)
    held = live_members(client, [soak.key(t, "held") for t in TENANTS], timeout_s=0)
    now = time.time()
    expiries = [score for members in (*parallel.values(), *held.values()) for _, score in members]
    by_replica = [load.faults.replica_last_metered or 0 if i == killed else metered(g.scrape(soak.admin_key))
                  for i, g in enumerate(soak.gateways)]
    if killed is not None:
        counted += load.faults.replica_last_requests or 0
    read_rate_keys(soak, load.underneath)
    ledger = {tenant: day_usage(survivors[0][1], soak.admin_key, tenant) for tenant in TENANTS}
    return Books(
        len(load.outcomes), counted, ledger, shadow_books(survivors[0][1], soak.admin_key), sum(by_replica),
        by_replica, unsettled,
        {k: [f"{m} (expires in {s - now:.0f}s)" for m, s in v] for k, v in held.items()},
        {k: [f"{m} (expires in {s - now:.0f}s)" for m, s in v] for k, v in parallel.items()},
        slot_leases(soak), round(max(expiries, default=now) - now, 1), dict(load.underneath.rpm_admitted),
        [f"{g.name}: {e}" for g in soak.gateways for e in g.logged_errors()])


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
    statuses_by_tenant: dict[str, dict[str, int]]
    by_replica: dict[str, int]  # requests answered by each replica
    failovers: int
    errors: dict[str, int]  # by detail
    degraded: dict[str, int]  # usage.routing.degraded reasons of completed answers
    samples: list[Sample]
    faults: Faults
    upstream_back_at_s: float | None  # when a new upstream was first seen after the kill
    completed_tokens: int  # usage.routing upstream prompt+completion over completed answers
    handoff_bound: int
    rpm_per_minute: dict[str, dict[str, Any]]  # minute (UTC HH:MM) -> store count, client 200s, attempts, outage
    cut_in_flight: int  # requests in flight on the killed replica when it was killed (client side)
    books: Books
    checks: list[Check] = field(default_factory=list)


def billed(routing: dict[str, Any]) -> int:
    return routing["upstream_prompt_tokens"] + routing["upstream_completion_tokens"]


def handoff_bound(completed: list[dict[str, Any]], params: SoakParams) -> int:
    """Billed tokens one hand-off can reach: its prompt (the largest mean prompt per call of a
    completed answer, plus max_tokens for the answer so far) and a span."""
    per_call = [math.ceil(r["upstream_prompt_tokens"] / r["upstream_calls"]) for r in completed if r["upstream_calls"]]
    return max(per_call, default=0) + params.max_tokens + params.span


def memory_windows(samples: list[Sample], duration_s: float, replicas: int) -> list[tuple[int, int] | None]:
    """Per replica: RSS at the first sample of the run's last half and at the last one (None: gone or too few)."""
    windows = []
    for index in range(replicas):
        late = [s.rss_kb[index] for s in samples if s.t_s >= duration_s / 2]
        windows.append((late[0], late[-1]) if len(late) >= 2 and None not in late else None)
    return windows


def upstream_back_at(samples: list[Sample], faults: Faults) -> float | None:
    if faults.upstream_killed_at_s is None:
        return None
    return next((s.t_s for s in samples if s.t_s > faults.upstream_killed_at_s
                 and s.upstream_pid not in (None, faults.upstream_killed_pid)), None)


def mark_cut(outcomes: list[Outcome], faults: Faults) -> list[Outcome]:
    """Failed transfers of requests in flight on the killed replica at the kill (they end within
    a few seconds of it) become `cut`: a connection reset under a request no balancer can replay."""
    if faults.replica_killed is None:
        return outcomes
    kill = faults.replica_killed_at_s

    def cut(o: Outcome) -> bool:
        return (o.kind == ERROR and o.status in (None, 200) and o.replica == faults.replica_killed
                and not o.failover and kill - 1 <= o.ended_s <= kill + 5 and not o.detail.startswith("ConnectError"))

    return [dataclasses.replace(o, kind=CUT) if cut(o) else o for o in outcomes]


def rpm_table(outcomes: list[Outcome], books: Books, misses: list[float], faults: Faults,
              started_wall: float) -> dict[str, dict[str, Any]]:
    attempts = Counter(int(o.sent_at // 60) for o in outcomes if o.tenant == RPM)
    admitted = Counter(int(o.sent_at // 60) for o in outcomes if o.tenant == RPM and o.status == 200)
    outage = {int(t // 60) for t in misses}
    # any store fault: a replica whose calls fail three times in a row skips the whole store for a
    # second (adapters/redis_store.py), so even a tenant on a surviving cluster node goes unmetered
    if faults.redis_restarted_at_s is not None:
        start = started_wall + faults.redis_restarted_at_s
        outage |= {int(start // 60), int((start + (faults.redis_down_s or 0) + 2) // 60)}
    table = {}
    for minute in sorted(set(attempts) | set(books.rpm_admitted)):
        label = time.strftime("%H:%M", time.gmtime(minute * 60))
        table[label] = {"store": books.rpm_admitted.get(minute), "client_200": admitted.get(minute, 0),
                        "attempts": attempts.get(minute, 0), "store_outage": minute in outage}
    return table


def summarize(params: SoakParams, workdir: Path, load: Load, books: Books) -> Report:
    outcomes = mark_cut(load.outcomes, load.faults)
    completed = [o.routing for o in outcomes if o.routing is not None]
    requests = Counter(o.kind for o in outcomes)
    requests.update(("stream" if o.stream else "plain") for o in outcomes)
    started_wall = min((o.sent_at for o in outcomes), default=time.time())
    report = Report(
        params=dataclasses.asdict(params), workdir=str(workdir), seconds=round(load.seconds, 1),
        requests={"total": len(outcomes), **requests},
        statuses=dict(Counter(str(o.status or "none") for o in outcomes)),
        statuses_by_tenant={t: dict(Counter(str(o.status or "none") for o in outcomes if o.tenant == t)) for t in TENANTS},
        by_replica={str(i): sum(o.replica == i for o in outcomes) for i in range(params.replicas)},
        failovers=load.failovers,
        errors=dict(Counter(o.detail for o in outcomes if o.kind in (ERROR, CUT)).most_common()),
        degraded=dict(Counter(reason for r in completed for reason in r["degraded"])),
        samples=load.underneath.samples, faults=load.faults,
        upstream_back_at_s=upstream_back_at(load.underneath.samples, load.faults),
        completed_tokens=sum(billed(r) for r in completed), handoff_bound=handoff_bound(completed, params),
        rpm_per_minute=rpm_table(outcomes, books, load.underneath.store_misses, load.faults, started_wall),
        cut_in_flight=requests.get(CUT, 0), books=books,
    )
    report.checks = checks(report, params)
    return report


def checks(report: Report, params: SoakParams) -> list[Check]:
    books, faults = report.books, report.faults
    ledger = sum(books.ledger.values())
    errors = report.requests.get(ERROR, 0)
    fives = sum(n for status, n in report.statuses.items() if status.startswith("5") and status != "503")
    capped = books.ledger[CAPPED]
    killed = faults.replica_killed is not None
    replica_wanted = params.kill_replica and params.replicas > 1
    exercised = (faults.upstream_killed_pid is not None and faults.redis_down_s is not None and books.metered > 0
                 and killed == replica_wanted)
    growth = [(i, w) for i, w in enumerate(memory_windows(report.samples, params.duration_s, params.replicas))
              if i != faults.replica_killed]
    memory_ok = all(w is not None and w[1] < w[0] * (1 + MEMORY_GROWTH_TARGET) for _, w in growth)
    memory = "; ".join(f"r{i} too few samples" if w is None else
                       f"r{i} {w[0] / 1024:.0f}->{w[1] / 1024:.0f} MB ({w[1] / w[0] - 1:+.1%})" for i, w in growth)
    # the killed replica's counters stop at its last scrape: calls it ended after it (a few ms) may differ
    slack = report.cut_in_flight * report.handoff_bound if killed else 0
    leftovers = sum(map(len, books.held.values())) + sum(map(len, books.parallel.values())) + len(books.slot_leases)
    leftovers_allowed = report.cut_in_flight * 2 if killed else 0  # a reservation and a slot per cut request
    rpm_store = max((m["store"] or 0 for m in report.rpm_per_minute.values()), default=0)
    rpm_client = max((m["client_200"] for m in report.rpm_per_minute.values() if not m["store_outage"]), default=0)
    rpm_refused = any(m["attempts"] > m["client_200"] for m in report.rpm_per_minute.values())
    shadow = books.shadow
    return [
        Check("0 exercised", "faults done, tokens billed",
              f"upstream pid {faults.upstream_killed_pid}, replica {faults.replica_killed}, "
              f"store down {faults.redis_down_s}s, {books.metered} tokens", exercised),
        Check("1 errors", "0 errors, 0 5xx but 503 (429s, disconnects, cut by kill apart)",
              f"{errors} of {report.requests['total']}, {fives} 5xx, {report.statuses.get('503', 0)} 503 "
              f"(queue full), {report.cut_in_flight} cut", errors == 0 and fives == 0),
        Check(MEMORY_CHECK, f"RSS growth < {MEMORY_GROWTH_TARGET:.0%} over the last half", memory, memory_ok),
        Check("3 ledger", "ledger == sum of /metrics (+-cut x hand-off)",
              f"ledger {ledger}, /metrics {books.metered} ({'+'.join(map(str, books.metered_by_replica))}), "
              f"diff {ledger - books.metered:+d}, slack {slack}",
              abs(ledger - books.metered) <= slack and books.metered >= report.completed_tokens - slack),
        Check("4 reservations", "0 unsettled; held only the killed replica's",
              f"{sum(map(len, books.held.values()))} held, {books.unsettled} unsettled",
              books.unsettled == 0 and (not books.held or killed)),
        Check("5 parallel slots", f"0 held (a killed replica: <= 2 x {report.cut_in_flight} cut, expiring)",
              f"{leftovers} held (par {sum(map(len, books.parallel.values()))}, leases {len(books.slot_leases)}), "
              f"all gone in {books.expires_by_s:.0f}s",
              leftovers <= leftovers_allowed and books.expires_by_s <= 10 * RESERVATION_TTL_S + 5),
        Check("6 budget", f"capped <= {params.budget_tokens} + {params.replicas} x hand-off ({report.handoff_bound})",
              f"{capped} (overshoot {capped - params.budget_tokens:+d})",
              capped <= params.budget_tokens + params.replicas * report.handoff_bound),
        Check("7 rpm", f"<= {params.rpm} admitted per minute (store keys)",
              f"store max {rpm_store}, client 200s max {rpm_client}, {'refused' if rpm_refused else 'never refused'}",
              rpm_store <= params.rpm and rpm_client <= params.rpm),
        Check("8 shadow", f"answers compared; operator <= {params.shadow_budget_tokens} + {params.replicas} x call "
              f"({shadow_call_bound(report)})",
              f"{shadow['compared']} compared, {shadow['overridden']} overridden apart, operator {shadow['tokens']} tokens",
              shadow["compared"] + shadow["overridden"] > 0
              and shadow["tokens"] <= params.shadow_budget_tokens + params.replicas * shadow_call_bound(report)),
    ]


def shadow_call_bound(report: Report) -> int:
    """Billed tokens one shadow call can reach: a hand-off's prompt bound and its whole answer."""
    return report.handoff_bound + report.params["max_tokens"]


def print_report(report: Report) -> None:
    p, r, books, faults = report.params, report.requests, report.books, report.faults
    print(f"soak: {report.seconds:.0f} s, {p['replicas']} replica(s) on {'a Redis Cluster' if p['cluster'] else 'one Redis'}, "
          f"{p['clients']} clients + rpm {p['rpm_sends_per_min']:.0f}/min, upstream {p['upstream_model']}, capped budget {p['budget_tokens']} tokens; "
          f"work directory {report.workdir}")
    print(f"requests  {r['total']} sent: {r.get(OK, 0)} ok, {r.get(ABANDONED, 0)} abandoned, "
          f"{r.get(REFUSED, 0)} refused, {r.get(ERROR, 0)} errors, {r.get(CUT, 0)} cut by the replica kill "
          f"({r.get('stream', 0)} streaming, {r.get('plain', 0)} not); the gateways counted {books.counted_by_gateways}")
    print(f"replicas  answered {', '.join(f'r{k}: {v}' for k, v in report.by_replica.items())}; "
          f"{report.failovers} fail-overs")
    print(f"statuses  {', '.join(f'{k}: {v}' for k, v in sorted(report.statuses.items()))}; by tenant "
          f"{'; '.join(f'{t} ' + ' '.join(f'{k}:{v}' for k, v in sorted(c.items())) for t, c in report.statuses_by_tenant.items())}")
    print(f"degraded  {', '.join(f'{k}: {v}' for k, v in report.degraded.items()) or 'none'}")
    back = "not seen again" if report.upstream_back_at_s is None else f"a new one at {report.upstream_back_at_s} s"
    print(f"faults    upstream pid {faults.upstream_killed_pid} SIGKILLed at {faults.upstream_killed_at_s} s ({back}); "
          f"replica {faults.replica_killed} SIGKILLed at {faults.replica_killed_at_s} s; "
          f"{faults.redis_killed} SIGKILLed at {faults.redis_restarted_at_s} s, down {faults.redis_down_s} s")
    for index in range(p["replicas"]):
        trace = ", ".join(f"{s.t_s:.0f}:{s.rss_kb[index] / 1024:.0f}" for s in report.samples[::3]
                          if s.rss_kb[index] is not None)
        print(f"memory    r{index} RSS MB at t(s): {trace}")
    print(f"ledger    {', '.join(f'{t} {n}' for t, n in books.ledger.items())}; /metrics {books.metered} "
          f"(by replica {books.metered_by_replica}); completed answers {report.completed_tokens}")
    print("rpm       " + "; ".join(f"{k} store {v['store']} / 200s {v['client_200']} / sent {v['attempts']}"
                                   f"{' (store outage)' if v['store_outage'] else ''}"
                                   for k, v in report.rpm_per_minute.items()))
    for detail, count in list(report.errors.items())[:5]:
        print(f"error     {count} x {detail}")
    for key, members in {**books.held, **books.parallel}.items():
        print(f"left      {key}: {len(members)}, e.g. {'; '.join(members[:3])}")
    for lease in books.slot_leases:
        print(f"left      {lease}")
    if books.logged_errors:
        print(f"gateway   {len(books.logged_errors)} error log lines, e.g. {books.logged_errors[0][:200]}")
    print(f"\n{'check':18s} {'target':52s} {'measured':70s} result")
    for check in report.checks:
        print(f"{check.name:18s} {check.target:52s} {check.measured:70s} {'PASS' if check.passed else 'FAIL'}")


# -- the whole soak --

def run_soak(params: SoakParams, workdir: Path) -> Report:
    """Start the store, the upstream and the replicas, run the load with its faults, read the books, stop everything."""
    keys = {tenant: f"sk-soak-{tenant}-{secrets.token_hex(8)}" for tenant in TENANTS}
    admin_key = f"sk-soak-admin-{secrets.token_hex(8)}"
    env = {**{key_env(t): k for t, k in keys.items()}, "SOAK_ADMIN_KEY": admin_key}
    prefix = f"soak-{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(PrivateCluster(workdir) if params.cluster else PrivateRedis(workdir))
        upstream = None
        if params.replicas > 1:
            upstream = stack.enter_context(SharedUpstream(params.upstream_model, params.shared_slots, 2, workdir))
        gateways = []
        for index in range(params.replicas):
            name = "gateway" if params.replicas == 1 else f"gateway-{index}"
            gateway = GatewayProcess(gateway_config(params, store.url, prefix, upstream), workdir, env, name)
            stack.callback(gateway.close)
            gateways.append(gateway)
        for gateway in gateways:
            gateway.wait_ready()
        soak = Soak(params, store, upstream, gateways, prefix, admin_key)
        load = asyncio.run(run_load(soak, keys))
        books = read_books(soak, load)
    return summarize(params, workdir, load, books)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rpm", type=int, default=SoakParams.rpm,
                        help="requests_per_minute of the rpm tenant (60; on 2 cores the gateways admit ~30/min of it)")
    parser.add_argument("--replicas", type=int, default=1, help="gateway processes sharing the store")
    parser.add_argument("--cluster", action="store_true", help="the store is a private 3-node Redis Cluster")
    parser.add_argument("--kill-replica", action="store_true", help="SIGKILL the last replica at half the run")
    parser.add_argument("--upstream-model", default=SoakParams.upstream_model,
                        help="catalog name or GGUF path of the upstream")
    parser.add_argument("--budget-tokens", type=int, default=SoakParams.budget_tokens,
                        help="daily upstream_tokens of the capped tenant")
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args()
    if args.kill_replica and args.replicas < 2:
        parser.error("--kill-replica needs --replicas 2 or more")
    params = SoakParams(duration_s=args.minutes * 60, clients=args.clients, upstream_model=args.upstream_model,
                        budget_tokens=args.budget_tokens, replicas=args.replicas, rpm=args.rpm, cluster=args.cluster,
                        kill_replica=args.kill_replica)
    report = run_soak(params, Path(tempfile.mkdtemp(prefix="soak-")))
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=2))
    return 0 if all(check.passed for check in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
