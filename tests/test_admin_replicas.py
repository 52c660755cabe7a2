"""Two gateway replicas on one Redis, changed through the admin API of either: a key issued on one
works on both within a second, a revoked one is refused on both within a second, a budget raised
on one is enforced on both, and two rotations of one key at once leave exactly one secret working.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import ADMIN_KEY, gateway_config, live_gateway

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROPAGATION_S = 1.0  # the directory's promise: a change is honoured by every replica within this
ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def replicas(smol_upstream, redis_url, tmp_path_factory):
    prefix = f"test-admin-{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("admin-replicas")
    with contextlib.ExitStack() as stack:
        gateways = []
        for _ in range(2):
            config = gateway_config(smol_upstream, store={"backend": "redis", "url": redis_url, "key_prefix": prefix})
            gateways.append(stack.enter_context(live_gateway(config, tmp)))
        yield gateways


def status_on(gateway, key: str) -> int:
    return httpx.get(f"{gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


def seconds_until(replicas, key: str, expected: int) -> float:
    """How long until every replica answers `key` with `expected`; fails past PROPAGATION_S."""
    start = time.monotonic()
    pending = list(replicas)
    while pending:
        pending = [g for g in pending if status_on(g, key) != expected]
        elapsed = time.monotonic() - start
        assert elapsed <= PROPAGATION_S or not pending, f"{len(pending)} replica(s) not there after {elapsed:.2f}s"
        time.sleep(0.02)
    return time.monotonic() - start


def admin(gateway, method: str, path: str, json: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"{gateway.base_url}{path}", headers=ADMIN, json=json, timeout=30)


def test_a_key_issued_on_one_replica_works_on_both_and_once_revoked_on_neither(replicas):
    one, two = replicas
    assert admin(one, "POST", "/admin/tenants", {"id": "live"}).status_code == 201
    issued = admin(one, "POST", "/admin/tenants/live/keys", {"name": "ci"}).json()
    seconds_until(replicas, issued["key"], 200)
    assert admin(two, "DELETE", f"/admin/keys/{issued['id']}").json()["deleted"] is True
    seconds_until(replicas, issued["key"], 401)
    audit = admin(one, "GET", "/admin/audit").json()["data"]
    assert [e["action"] for e in audit[:3]] == ["key.revoke", "key.issue", "tenant.create"]


def test_a_budget_raised_on_one_replica_is_enforced_on_both(replicas):
    one, two = replicas
    admin(one, "POST", "/admin/tenants", {"id": "frugal", "daily": {"upstream_tokens": 0},
                                         "on_budget_exhausted": "refuse"})
    key = admin(one, "POST", "/admin/tenants/frugal/keys", {"name": "app"}).json()["key"]
    seconds_until(replicas, key, 200)

    def ask(gateway) -> httpx.Response:  # a question of its own each time: no answer comes from the cache
        question = [{"role": "user", "content": f"Count from {uuid.uuid4().int % 1000} upwards."}]
        return httpx.post(f"{gateway.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=120, json={"model": "routed", "messages": question, "max_tokens": 4,
                                             "temperature": 0, "routing": {"policy": "always"}})

    for gateway in replicas:
        refused = ask(gateway)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
    admin(two, "PATCH", "/admin/tenants/frugal", {"daily": {"upstream_tokens": 100_000}})
    time.sleep(PROPAGATION_S)
    for gateway in replicas:
        answer = ask(gateway)
        assert answer.status_code == 200, answer.text
        routing = answer.json()["usage"]["routing"]
        assert routing["upstream_prompt_tokens"] > 0 and "budget_exhausted" not in routing["degraded"], routing


def test_two_replicas_racing_to_rotate_one_key_leave_exactly_one_secret_working(replicas):
    one, two = replicas
    admin(one, "POST", "/admin/tenants", {"id": "racing"})
    issued = admin(one, "POST", "/admin/tenants/racing/keys", {"name": "shared"}).json()
    old = issued["key"]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            answers = list(pool.map(lambda g: admin(g, "POST", f"/admin/keys/{issued['id']}/rotate"), replicas))
            assert {a.status_code for a in answers} <= {200, 409} and 200 in {a.status_code for a in answers}
            conflict = [a for a in answers if a.status_code == 409]
            assert all(a.json()["error"]["code"] == "conflict" for a in conflict)
            secrets = [a.json()["key"] for a in answers if a.status_code == 200]
            time.sleep(PROPAGATION_S)
            working = [s for s in [old, *secrets] if status_on(one, s) == 200]
            assert len(working) == 1 and working[0] in secrets, (len(working), len(secrets))
            assert status_on(two, working[0]) == 200
            old = working[0]
    rotations = [e for e in admin(one, "GET", "/admin/audit").json()["data"]
                 if e["action"] == "key.rotate" and e["key"] == issued["id"]]
    assert 5 <= len(rotations) <= 10


def test_a_scoped_key_used_on_another_alias_is_refused_like_an_alias_its_tenant_may_not_use(replicas):
    one, _ = replicas
    scoped = admin(one, "POST", "/admin/tenants/demo/keys", {"name": "local-only", "scopes": ["local"]}).json()
    seconds_until(replicas, scoped["key"], 200)
    models = httpx.get(f"{one.base_url}/v1/models", headers={"Authorization": f"Bearer {scoped['key']}"}).json()
    assert [m["id"] for m in models["data"]] == ["local"]
    refused = httpx.post(f"{one.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {scoped['key']}"},
                         timeout=60, json={"model": "routed", "messages": ASK, "max_tokens": 2})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


def test_an_expired_key_is_refused_on_both_replicas(replicas):
    one, _ = replicas
    issued = admin(one, "POST", "/admin/tenants/demo/keys", {"name": "brief", "expires_in_s": 2}).json()
    seconds_until(replicas, issued["key"], 200)
    time.sleep(max(0.0, issued["expires_at"] - time.time()) + 0.1)
    assert [status_on(g, issued["key"]) for g in replicas] == [401, 401]
