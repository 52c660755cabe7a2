"""The admin API over tenants and keys, in process: the real TenantDirectory on a real Store (the
in-process one, and Redis for what only Redis can show), the app driven over HTTP.

Replicas as separate processes are tests/test_admin_replicas.py's; the admin page in a browser is
tests/test_admin_page.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from types import SimpleNamespace

import pytest
import redis
from fastapi.testclient import TestClient

from adapters.memory_store import MemoryStore
from adapters.redis_store import RedisStore
from adapters.store import DirectoryWrite
from gateway.api.admin import api as admin_api
from gateway.api.app import create_app
from gateway.api.routes import router as other_routes
from gateway.settings import Settings
from gateway.tenancy.budget import Ledger
from gateway.tenancy.changes import DirectoryChanges
from gateway.tenancy.records import key_digest
from gateway.tenancy.tenants import TenantDirectory
from tests.conftest import ADMIN_KEY, DEMO_KEY, free_port, gateway_config, private_redis, stop

ENV = {"TEST_DEMO_KEY": DEMO_KEY, "TEST_ADMIN_KEY": ADMIN_KEY}
UPSTREAM = "http://127.0.0.1:9"  # never called: the aliases "local" and "routed" exist, no model answers


def admin_app(store, config: dict | None = None):
    """The real app over a runtime with no model: the real directory, following `store`."""
    settings = Settings.model_validate(config or gateway_config(UPSTREAM))

    async def start(_settings):
        tenants = TenantDirectory(settings.tenants, ENV, settings.admin_key_env)
        await tenants.seed_store(store)
        await tenants.refresh(store)
        follow = asyncio.create_task(tenants.keep_current(store))

        async def close():
            follow.cancel()

        aliases = {name: SimpleNamespace(settings=alias, router=None) for name, alias in settings.aliases.items()}
        return SimpleNamespace(settings=settings, aliases=aliases, local_models={}, shadow=None, close=close,
                               tenants=tenants, ledger=Ledger(store))

    return create_app(settings, start_runtime=start)


@pytest.fixture
def client():
    with TestClient(admin_app(MemoryStore())) as running:
        yield running


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


ADMIN = auth(ADMIN_KEY)


def issue(client, tenant: str = "demo", **body) -> dict:
    response = client.post(f"/admin/tenants/{tenant}/keys", headers=ADMIN, json={"name": "ci", **body})
    assert response.status_code == 201, response.text
    return response.json()


def admin_routes() -> list[tuple[str, str]]:
    """Every admin endpoint (the page at /admin itself holds nothing and needs no key)."""
    found = []
    for route in [*admin_api.routes, *other_routes.routes]:
        path = getattr(route, "path", "")
        if path.startswith("/admin/"):
            for method in sorted(route.methods - {"HEAD"}):
                found.append((method, path.replace("{tenant_id}", "demo").replace("{key_id}", "key_config_demo")))
    return found


def test_a_tenant_key_is_refused_on_every_admin_route_and_no_key_is_a_401(client):
    routes = admin_routes()
    assert {("POST", "/admin/keys/key_config_demo/rotate"), ("DELETE", "/admin/keys/key_config_demo"),
            ("PATCH", "/admin/tenants/demo"), ("GET", "/admin/audit")} <= set(routes)
    for method, path in routes:
        as_tenant = client.request(method, path, headers=auth(DEMO_KEY), json={"name": "x"})
        assert as_tenant.status_code == 403, (method, path, as_tenant.text)
        assert as_tenant.json()["error"]["code"] == "permission_denied"
        # a body that is not JSON: the key is checked before the body is read
        anonymous = client.request(method, path, content=b"{not json", headers={"content-type": "application/json"})
        assert anonymous.status_code == 401, (method, path, anonymous.text)
        assert anonymous.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers=auth(DEMO_KEY)).status_code == 200  # the demo key was not rotated


def test_an_issued_key_is_shown_once_stored_as_a_digest_and_works_at_once(client):
    issued = issue(client, scopes=["local"], expires_in_s=3600)
    assert issued["key"].startswith("sk-") and issued["tenant"] == "demo" and issued["scopes"] == ["local"]
    assert client.get("/v1/usage", headers=auth(issued["key"])).json()["tenant"] == "demo"
    shown = client.get(f"/admin/keys/{issued['id']}", headers=ADMIN).json()
    listed = client.get("/admin/tenants/demo/keys", headers=ADMIN).json()["data"]
    audit = client.get("/admin/audit", headers=ADMIN).text
    for text in (json.dumps(shown), json.dumps(listed), audit):
        assert issued["key"] not in text and key_digest(issued["key"]) not in text
    assert {k["name"] for k in listed} == {"ci", "config.yaml"}
    assert shown["expires_at"] == pytest.approx(time.time() + 3600, abs=5)


def test_several_keys_per_tenant_each_revoked_on_its_own(client):
    first, second = issue(client, name="one"), issue(client, name="two")
    revoked = client.delete(f"/admin/keys/{first['id']}", headers=ADMIN)
    assert revoked.json() == {"id": first["id"], "object": "key", "tenant": "demo", "deleted": True}
    refused = client.get("/v1/usage", headers=auth(first["key"]))
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/usage", headers=auth(second["key"])).status_code == 200
    assert client.delete(f"/admin/keys/{first['id']}", headers=ADMIN).status_code == 404


def test_a_rotated_key_refuses_its_old_secret_and_keeps_its_name_and_scopes(client):
    issued = issue(client, name="rotating", scopes=["routed"])
    rotated = client.post(f"/admin/keys/{issued['id']}/rotate", headers=ADMIN).json()
    assert rotated["id"] == issued["id"] and rotated["name"] == "rotating" and rotated["scopes"] == ["routed"]
    assert rotated["key"] != issued["key"]
    assert client.get("/v1/usage", headers=auth(issued["key"])).status_code == 401
    assert client.get("/v1/usage", headers=auth(rotated["key"])).status_code == 200


def test_an_expired_key_is_a_401_on_the_next_request(client):
    """Its expiry is at least `expires_in_s` away (it was whole seconds from now, rounded down: a
    key given 1 s could expire 0.1 s after it was issued), and at most one second more."""
    started = time.time()
    issued = issue(client, expires_in_s=2)
    assert started + 2 <= issued["expires_at"] <= time.time() + 3
    assert client.get("/v1/usage", headers=auth(issued["key"])).status_code == 200
    time.sleep(max(0.0, issued["expires_at"] - time.time()) + 0.1)
    refused = client.get("/v1/usage", headers=auth(issued["key"]))
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_a_scoped_key_sees_only_its_aliases(client):
    issued = issue(client, scopes=["local"])
    models = client.get("/v1/models", headers=auth(issued["key"])).json()["data"]
    assert [m["id"] for m in models] == ["local"]
    assert {m["id"] for m in client.get("/v1/models", headers=auth(DEMO_KEY)).json()["data"]} == {"local", "routed"}
    unknown = client.post("/admin/tenants/demo/keys", headers=ADMIN, json={"name": "x", "scopes": ["nope"]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "scopes[0]"


def test_a_key_scoped_outside_its_tenants_aliases_is_refused(client):
    assert client.post("/admin/tenants", headers=ADMIN, json={"id": "narrow", "aliases": ["local"]}).status_code == 201
    outside = client.post("/admin/tenants/narrow/keys", headers=ADMIN, json={"name": "x", "scopes": ["local", "routed"]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "scopes[1]"
    assert [k["name"] for k in client.get("/admin/tenants/narrow/keys", headers=ADMIN).json()["data"]] == []


def test_a_tenant_is_created_and_its_budgets_and_limits_changed_by_merge_patch(client):
    created = client.post("/admin/tenants", headers=ADMIN, json={"id": "acme", "daily": {"upstream_tokens": 100,
                                                                                          "upstream_cost_usd": 1.0}})
    assert created.status_code == 201 and created.json()["keys"] == []
    assert client.post("/admin/tenants", headers=ADMIN, json={"id": "acme"}).status_code == 409
    operator = client.post("/admin/tenants", headers=ADMIN, json={"id": "shadow-operator"})
    assert operator.status_code == 400 and operator.json()["error"]["param"] == "id"
    patched = client.patch("/admin/tenants/acme", headers=ADMIN, json={
        "daily": {"upstream_tokens": 5000}, "rate_limits": {"requests_per_minute": 30}, "allow_upstream": False,
        "aliases": ["local"]})
    settings = patched.json()["settings"]
    assert settings["daily"] == {"upstream_tokens": 5000, "upstream_cost_usd": 1.0}  # the cost limit stays
    assert settings["rate_limits"]["requests_per_minute"] == 30 and settings["allow_upstream"] is False
    cleared = client.patch("/admin/tenants/acme", headers=ADMIN, json={"aliases": None}).json()["settings"]
    assert cleared["aliases"] is None and cleared["daily"]["upstream_tokens"] == 5000
    tenants = {t["id"]: t for t in client.get("/admin/tenants", headers=ADMIN).json()["data"]}
    assert set(tenants) == {"demo", "acme"}
    key = issue(client, tenant="acme")["key"]
    assert client.get("/v1/usage", headers=auth(key)).json()["windows"][0]["limits"]["upstream_tokens"] == 5000
    actions = [e["action"] for e in client.get("/admin/audit", headers=ADMIN).json()["data"]]
    assert actions[:4] == ["key.issue", "tenant.update", "tenant.update", "tenant.create"]


@pytest.mark.parametrize(("body", "param"), [
    ({"daily": {"upstream_tokens": -1}}, "daily.upstream_tokens"),
    ({"rate_limits": {"per_hour": 3}}, "rate_limits.per_hour"),
    ({"api_key_sha256": "0" * 64}, "api_key_sha256"),
    ({"id": "other"}, "id"),
    ({"aliases": ["local", "nope"]}, "aliases[1]"),  # an alias that does not exist
    ({"routing": {"escalation": "draft"}}, "routing"),  # "routed" would refuse every request: start-up warns
])
def test_a_bad_change_is_a_400_naming_the_field_and_changes_nothing(client, body, param):
    before = client.get("/admin/tenants/demo", headers=ADMIN).json()
    refused = client.patch("/admin/tenants/demo", headers=ADMIN, json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert client.get("/admin/tenants/demo", headers=ADMIN).json() == before


def test_unknown_tenants_and_keys_are_404s(client):
    for method, path in [("GET", "/admin/tenants/nobody"), ("PATCH", "/admin/tenants/nobody"),
                         ("POST", "/admin/tenants/nobody/keys"), ("GET", "/admin/keys/key_nope"),
                         ("POST", "/admin/keys/key_nope/rotate"), ("DELETE", "/admin/keys/key_nope"),
                         ("GET", "/admin/tenants/nobody/usage")]:
        response = client.request(method, path, headers=ADMIN, json={"name": "x"} if method != "PATCH" else {})
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found", (method, path)


# -- the seeding rule: the Store wins --

def test_config_tenants_seed_the_store_once_and_the_store_wins_afterwards():
    store = MemoryStore()
    with TestClient(admin_app(store)) as client:
        client.patch("/admin/tenants/demo", headers=ADMIN, json={"daily": {"upstream_tokens": 777}})
    config = gateway_config(UPSTREAM)
    config["tenants"][0]["daily"] = {"upstream_tokens": 10}  # the file says otherwise now: ignored
    config["tenants"].append({"id": "late", "api_key_sha256": key_digest("sk-late")})  # new to the Store: seeded
    with TestClient(admin_app(store, config)) as client:
        demo = client.get("/admin/tenants/demo", headers=ADMIN).json()
        assert demo["settings"]["daily"]["upstream_tokens"] == 777
        assert client.get("/v1/usage", headers=auth("sk-late")).json()["tenant"] == "late"
        assert client.get("/v1/usage", headers=auth(DEMO_KEY)).status_code == 200


def test_a_write_whose_expectation_fails_writes_nothing(redis_url):
    async def run() -> tuple:
        store = RedisStore(redis_url, f"test-admin-{uuid.uuid4().hex[:8]}", 1.0, 60, 60)
        try:
            assert await store.directory_write([DirectoryWrite("tenants", "a", "{}", expected="")], "{}")
            ok = await store.directory_write([DirectoryWrite("keys", "k", "{}", expected=""),
                                              DirectoryWrite("tenants", "a", "{}", expected="")], "{}")
            return ok, await store.directory_read(), await store.audit_read(10)
        finally:
            await store.close()

    ok, records, audit = asyncio.run(run())
    assert ok is False and records.keys == {} and records.version.number == 1 and len(audit) == 1


# -- Redis down during a key change --

def durable_redis(port: int, directory):
    """A Redis of this test's own that writes every command to disk, so a restart shows what it held."""
    return private_redis(port, "--appendonly", "yes", "--appendfsync", "always", "--dir", str(directory))


def test_redis_down_during_a_key_change_is_a_503_and_nothing_is_half_written(tmp_path):
    port = free_port()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", "test-admin-down", 0.5, 60, 60)
    with durable_redis(port, tmp_path) as server, TestClient(admin_app(store)) as client:
        issued = issue(client, name="before")
        before = client.get("/admin/tenants/demo", headers=ADMIN).json()
        audit_before = client.get("/admin/audit", headers=ADMIN).json()
        stop(server)
        changes = [("POST", "/admin/tenants/demo/keys", {"name": "during"}),
                   ("POST", f"/admin/keys/{issued['id']}/rotate", None),
                   ("DELETE", f"/admin/keys/{issued['id']}", None),
                   ("PATCH", "/admin/tenants/demo", {"daily": {"upstream_tokens": 1}}),
                   ("POST", "/admin/tenants", {"id": "during"})]
        for method, path, body in changes:
            refused = client.request(method, path, headers=ADMIN, json=body)
            assert refused.status_code == 503, (method, path, refused.text)
            assert refused.json()["error"]["code"] == "store_unavailable"
            assert "unreachable" in refused.json()["error"]["message"]
        # lookups degrade to each replica's last copy: the keys known before still work
        assert client.get("/v1/models", headers=auth(issued["key"])).status_code == 200
        with durable_redis(port, tmp_path):  # the same data directory: what Redis held before
            time.sleep(1.1)  # the store's back-off after repeated failures ends
            assert client.get("/admin/tenants/demo", headers=ADMIN).json() == before
            assert client.get("/admin/audit", headers=ADMIN).json() == audit_before
            assert client.get("/v1/models", headers=auth(issued["key"])).status_code == 200


def test_a_redis_that_restarted_empty_is_seeded_again_from_the_file(redis_url):
    prefix = f"test-admin-{uuid.uuid4().hex[:8]}"

    async def run():
        store = RedisStore(redis_url, prefix, 1.0, 60, 60)
        settings = Settings.model_validate(gateway_config(UPSTREAM))
        directory = TenantDirectory(settings.tenants, ENV, settings.admin_key_env)
        try:
            await directory.seed_store(store)
            await directory.refresh(store)
            await DirectoryChanges(store, directory).create_tenant({"id": "made-by-api"})
            flushed = redis.Redis.from_url(redis_url)
            flushed.delete(*flushed.keys(f"{prefix}:*"))
            await directory.refresh(store)
            return directory.authenticate(DEMO_KEY), sorted(directory.by_id)
        finally:
            await store.close()

    demo, tenants = asyncio.run(run())
    assert demo.id == "demo" and tenants == ["demo"]


# -- what the admin API refuses, as start-up does --

def test_a_new_tenant_is_checked_as_start_up_checks_the_file(client):
    for body, param in [({"id": "acme", "aliases": ["nope"]}, "aliases[0]"),
                        ({"id": "acme", "routing": {"escalation": "draft"}, "aliases": ["routed"]}, "routing"),
                        ({"id": "shadow-operator"}, "id")]:
        refused = client.post("/admin/tenants", headers=ADMIN, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert "needs answer_value" in client.post("/admin/tenants", headers=ADMIN, json={
        "id": "acme", "routing": {"escalation": "draft"}}).json()["error"]["message"]
    assert [t["id"] for t in client.get("/admin/tenants", headers=ADMIN).json()["data"]] == ["demo"]
    completed = {"id": "acme", "routing": {"escalation": "draft", "answer_value": 1}, "aliases": ["routed"]}
    assert client.post("/admin/tenants", headers=ADMIN, json=completed).status_code == 201


# -- the audit log and the admin key --

def test_the_audit_log_names_the_admin_by_role_and_holds_nothing_of_its_key(client):
    issue(client)
    client.patch("/admin/tenants/demo", headers=ADMIN, json={"daily": {"upstream_tokens": 10}})
    audit = client.get("/admin/audit", headers=ADMIN).json()["data"]
    assert [e["actor"] for e in audit if e["action"] != "tenant.seed"] == ["admin", "admin"]
    assert key_digest(ADMIN_KEY)[:8] not in json.dumps(audit)


# -- records the gateway cannot read --

def test_a_key_record_of_another_gateway_version_is_left_out_of_lists_not_a_500(caplog):
    store = MemoryStore()
    with TestClient(admin_app(store)) as client:
        newer = json.dumps({"id": "key_newer", "tenant": "demo", "name": "x", "digest": "7a" * 32, "created_at": 1,
                            "a_field_from_a_newer_gateway": True})
        asyncio.run(store.directory_write([DirectoryWrite("keys", "key_newer", newer)], "{}"))
        listed = client.get("/admin/tenants", headers=ADMIN)
        assert listed.status_code == 200 and [k["name"] for k in listed.json()["data"][0]["keys"]] == ["config.yaml"]
        assert client.get("/admin/tenants/demo/keys", headers=ADMIN).status_code == 200
        unreadable = client.get("/admin/keys/key_newer", headers=ADMIN)
        assert unreadable.status_code == 500 and unreadable.json()["error"]["code"] == "unreadable_record"
    assert "key_newer" in caplog.text and "7a7a" not in caplog.text  # the log names the record, not its digest


# -- following the Store --

class FailingStore(MemoryStore):
    """An in-process store whose first version reads fail with an error that is not an outage."""

    failures = 2

    async def directory_version(self):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("a bug, not an outage")
        return await super().directory_version()


def test_an_unexpected_error_is_logged_and_the_directory_keeps_following(caplog):
    async def run():
        store = FailingStore()
        directory = TenantDirectory([], ENV, "TEST_ADMIN_KEY")
        follow = asyncio.create_task(directory.keep_current(store, interval_s=0.01))
        await store.directory_write([DirectoryWrite("tenants", "later", '{"id": "later"}')], "{}")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "later" in directory.by_id:
                break
        follow.cancel()
        return sorted(directory.by_id)

    with caplog.at_level(logging.ERROR, "gateway.tenancy"):
        assert asyncio.run(run()) == ["later"]
    logged = [r for r in caplog.records if "following the tenant directory failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # once while the same error repeats


class HeldReadStore(MemoryStore):
    """An in-process store whose next directory read, once `hold` is set, waits for it."""

    hold: asyncio.Event | None = None

    async def directory_read(self):
        records = await super().directory_read()
        if self.hold is not None:
            hold, self.hold = self.hold, None
            await hold.wait()
        return records


def test_a_slow_poll_never_installs_an_older_directory_over_an_admin_change():
    async def run():
        store = HeldReadStore()
        directory = TenantDirectory([], ENV, "TEST_ADMIN_KEY")
        changes = DirectoryChanges(store, directory)
        await changes.create_tenant({"id": "acme"})
        await store.directory_write([DirectoryWrite("tenants", "other", "{\"id\": \"other\"}")], "{}")  # a change
        store.hold = hold = asyncio.Event()
        poll = asyncio.create_task(directory.refresh(store))  # reads the directory before the key exists
        while store.hold is not None:
            await asyncio.sleep(0)
        issuing = asyncio.create_task(changes.issue_key("acme", "ci", None, None))
        await asyncio.sleep(0.05)  # the key is written; its refresh waits for the poll's, or overtakes it
        hold.set()
        await poll
        _, secret = await issuing
        return directory.authenticate(secret)

    tenant = asyncio.run(run())
    assert tenant is not None and tenant.id == "acme"


def test_a_redis_restarted_and_refilled_to_the_same_version_is_read_afresh(redis_url, caplog):
    prefix = f"test-admin-{uuid.uuid4().hex[:8]}"
    settings = Settings.model_validate(gateway_config(UPSTREAM))

    async def run():
        store = RedisStore(redis_url, prefix, 1.0, 60, 60)
        one, two = (TenantDirectory(settings.tenants, ENV, settings.admin_key_env) for _ in range(2))
        try:
            await one.seed_store(store)
            await one.refresh(store)
            await DirectoryChanges(store, one).create_tenant({"id": "made-by-api"})
            _, secret = await DirectoryChanges(store, one).issue_key("made-by-api", "ci", None, None)
            raw = redis.Redis.from_url(redis_url)
            version = raw.get(f"{prefix}:{{tenants:}}:version")  # the change counter replicas compare
            raw.delete(*raw.keys(f"{prefix}:*"))
            await two.seed_store(store)  # another replica seeds the empty Redis, then it changes again
            while int(raw.get(f"{prefix}:{{tenants:}}:version")) < int(version):
                await DirectoryChanges(store, two).create_tenant({"id": f"t{uuid.uuid4().hex[:6]}"})
            assert raw.get(f"{prefix}:{{tenants:}}:version") == version
            await one.refresh(store)
            return one.authenticate(secret), sorted(one.by_id) == sorted(two.by_id) != []
        finally:
            await store.close()

    with caplog.at_level(logging.WARNING, "gateway.tenancy"):
        gone, same = asyncio.run(run())
    assert gone is None and same
    assert any("lost the tenant directory" in r.getMessage() for r in caplog.records)


def test_a_seeded_key_changed_in_the_environment_is_named_at_start_up(caplog):
    settings = Settings.model_validate(gateway_config(UPSTREAM))

    async def run():
        store = MemoryStore()
        await TenantDirectory(settings.tenants, ENV, settings.admin_key_env).seed_store(store)
        changed = TenantDirectory(settings.tenants, {**ENV, "TEST_DEMO_KEY": "sk-changed"}, settings.admin_key_env)
        await changed.seed_store(store)
        await changed.refresh(store)
        return changed.authenticate("sk-changed"), changed.authenticate(DEMO_KEY)

    with caplog.at_level(logging.WARNING, "gateway.tenancy"):
        new, old = asyncio.run(run())
    assert new is None and old.id == "demo"  # the Store wins
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "tenants.demo" in warned[0] and "POST /admin/keys/key_config_demo/rotate" in warned[0]
    assert "sk-changed" not in warned[0]


# -- Redis's eviction policy --

@pytest.mark.parametrize(("policy", "warned"), [("allkeys-lru", True), ("volatile-lru", False), ("noeviction", False)])
def test_a_redis_that_may_evict_the_directory_is_named_once(tmp_path, caplog, policy, warned):
    port = free_port()

    async def run():
        store = RedisStore(f"redis://127.0.0.1:{port}/0", "test-admin-evict", 1.0, 60, 60)
        try:
            for _ in range(2):
                await store.directory_read()
        finally:
            await store.close()

    with private_redis(port, "--dir", str(tmp_path), "--maxmemory-policy", policy), caplog.at_level(logging.WARNING):
        asyncio.run(run())
    named = [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert len(named) == (1 if warned else 0)
    assert all(policy in r.getMessage() and "noeviction" in r.getMessage() for r in named)
