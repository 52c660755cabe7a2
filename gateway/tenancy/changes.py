"""Changes to the tenant directory made through the admin API: create and update tenants, issue,
rotate and revoke keys, read them and the audit log.

Each change is one `Store.directory_write`: its records, the directory's version and its audit
entry are written together or not at all, and only if the records it read are still unchanged
(compare-and-set), so two replicas changing one record at once cannot lose either change unseen.
A Store that does not answer refuses the change (503) and writes nothing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from adapters.store import DirectoryWrite, Store, StoreUnavailable
from gateway.settings import TenantSettings
from gateway.tenancy.records import (
    KEY_FIELDS,
    KeyRecord,
    audit_entry,
    key_digest,
    new_key_id,
    new_secret,
    tenant_from_dict,
    tenant_from_json,
    tenant_json,
    unreadable,
)
from gateway.tenancy.tenants import ADMIN_ACTOR, TenantDirectory
from gateway.wire.errors import GatewayError, InvalidRequest, param_of, quoted

ATTEMPTS = 3  # a compare-and-set that lost a race re-reads and tries again this often
log = logging.getLogger("gateway.tenancy")
TenantCheck = Callable[[TenantSettings], None]  # raises InvalidRequest for settings this gateway refuses


class NotFound(InvalidRequest):
    status, code = 404, "not_found"


class Conflict(InvalidRequest):
    status, code = 409, "conflict"


class DirectoryUnavailable(GatewayError):
    status, type, code = 503, "server_error", "store_unavailable"


class UnreadableRecord(GatewayError):
    status, type, code = 500, "server_error", "unreadable_record"


def invalid_settings(exc: ValidationError) -> InvalidRequest:
    first = exc.errors()[0]
    return InvalidRequest(first["msg"].removeprefix("Value error, "), param=param_of(tuple(first["loc"])))


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON Merge Patch: objects merge key by key, null removes a key (its default returns)."""
    merged = dict(target)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_patch(merged[key], value)
        else:
            merged[key] = value
    return merged


class DirectoryChanges:
    """The admin API's view of the tenant directory in `store`; the audit log names the caller
    ADMIN_ACTOR. Every tenant's settings a change would store pass `check` first (the gateway's own
    checks: aliases that exist, routing that runs). After each change, this replica's `directory`
    is reloaded at once. A record written by another version of the gateway is left out of lists."""

    def __init__(self, store: Store, directory: TenantDirectory, check: TenantCheck = lambda _: None) -> None:
        self.store, self.directory, self.check = store, directory, check

    async def _call(self, work: Awaitable[Any]) -> Any:
        try:
            return await work
        except StoreUnavailable as exc:
            raise DirectoryUnavailable("the store holding tenants and keys is unreachable; nothing was changed or "
                                       "read (if Redis timed out after taking a change, it was applied whole: read "
                                       "it back before retrying)") from exc

    async def _write(self, writes: list[DirectoryWrite], action: str, **what: Any) -> bool:
        entry = audit_entry(ADMIN_ACTOR, action, **what)
        done = await self._call(self.store.directory_write(writes, entry))
        if done:
            try:
                await self.directory.refresh(self.store)
            except StoreUnavailable:
                pass  # the background refresh catches up
            except Exception:  # the change is made: it must not be answered as failed
                log.exception("reloading the tenant directory after a change failed; the background refresh "
                              "catches up")
        return done

    # -- reading --

    async def _records(self) -> tuple[dict[str, str], dict[str, KeyRecord]]:
        """Every tenant's stored text by id, and every key record this gateway can read, by id."""
        records = await self._call(self.store.directory_read())
        keys = {}
        for key_id, text in records.keys.items():
            try:
                keys[key_id] = KeyRecord.model_validate_json(text)
            except ValidationError as exc:  # written by another version of the gateway
                log.warning("key %s in the Store is not valid here, left out: %s", key_id, unreadable(exc))
        return records.tenants, keys

    async def tenants(self) -> list[tuple[TenantSettings, list[KeyRecord]]]:
        """Every tenant this gateway can read, in id order, each with its keys."""
        tenants, keys = await self._records()
        listed = []
        for tenant_id, text in sorted(tenants.items()):
            try:
                listed.append((tenant_from_json(text), [k for k in keys.values() if k.tenant == tenant_id]))
            except (ValidationError, ValueError) as exc:
                log.warning("tenant %s in the Store is not valid here, left out: %s", tenant_id, unreadable(exc))
        return listed

    async def tenant(self, tenant_id: str) -> tuple[TenantSettings, list[KeyRecord]]:
        """One tenant and its keys; NotFound if there is none, UnreadableRecord if it cannot be read."""
        tenants, keys = await self._records()
        settings = _readable(tenant_id, _tenant_text(tenants, tenant_id))
        return settings, [k for k in keys.values() if k.tenant == tenant_id]

    async def key(self, key_id: str) -> tuple[KeyRecord, str]:
        """The key's record and its stored text (what a compare-and-set expects)."""
        records = await self._call(self.store.directory_read())
        text = records.keys.get(key_id)
        if text is None:
            raise NotFound(f"no key '{quoted(key_id)}'", param="key_id")
        try:
            return KeyRecord.model_validate_json(text), text
        except ValidationError as exc:
            raise UnreadableRecord(f"key '{key_id}' was written by another version of the gateway and cannot be "
                                   "read here") from exc

    async def audit(self, limit: int) -> list[dict[str, Any]]:
        """The latest `limit` audit entries, newest first."""
        return [json.loads(entry) for entry in await self._call(self.store.audit_read(limit))]

    # -- tenants --

    async def create_tenant(self, body: dict[str, Any]) -> TenantSettings:
        """Store a new tenant from its settings; 400 if they are invalid or refused, 409 if the id is taken."""
        _refuse_key_fields(body)
        settings = self._checked(body)
        text = tenant_json(settings)
        if not await self._write([DirectoryWrite("tenants", settings.id, text, expected="")], "tenant.create",
                                 tenant=settings.id, settings=json.loads(text)):
            raise Conflict(f"tenant '{settings.id}' exists already", param="id")
        return settings

    async def update_tenant(self, tenant_id: str, patch: dict[str, Any]) -> TenantSettings:
        """Apply `patch` (a JSON Merge Patch of the tenant's settings) to the tenant as it is now."""
        _refuse_key_fields(patch)
        if patch.get("id", tenant_id) != tenant_id:
            raise InvalidRequest("a tenant's id cannot change", param="id")
        for _ in range(ATTEMPTS):
            held = _tenant_text((await self._call(self.store.directory_read())).tenants, tenant_id)
            settings = self._checked(merge_patch(json.loads(held), patch))
            write = DirectoryWrite("tenants", tenant_id, tenant_json(settings), expected=held)
            if await self._write([write], "tenant.update", tenant=tenant_id, changes=patch):
                return settings
        raise Conflict(f"tenant '{tenant_id}' kept changing while it was updated; retry", param="tenant_id")

    # -- keys --

    async def issue_key(self, tenant_id: str, name: str, expires_at: int | None,
                        scopes: list[str] | None) -> tuple[KeyRecord, str]:
        """A new key for the tenant: its record and the key itself, which is shown this once."""
        tenant_text = _tenant_text((await self._call(self.store.directory_read())).tenants, tenant_id)
        secret = new_secret()
        record = KeyRecord(id=new_key_id(), tenant=tenant_id, name=name, digest=key_digest(secret),
                           created_at=int(time.time()), expires_at=expires_at, scopes=scopes)
        writes = [DirectoryWrite("tenants", tenant_id, tenant_text, expected=tenant_text),  # it still exists
                  DirectoryWrite("keys", record.id, record.model_dump_json(), expected="")]
        if not await self._write(writes, "key.issue", tenant=tenant_id, key=record.id, name=name,
                                 expires_at=expires_at, scopes=scopes):
            raise Conflict(f"tenant '{tenant_id}' changed while a key was issued; retry", param="tenant_id")
        return record, secret

    async def rotate_key(self, key_id: str) -> tuple[KeyRecord, str]:
        """A new secret for the key (same id, name, expiry and scopes); the old one stops working.
        Of two rotations at once, one wins and the other is a 409."""
        record, text = await self.key(key_id)
        secret = new_secret()
        rotated = record.model_copy(update={"digest": key_digest(secret), "rotated_at": int(time.time())})
        write = DirectoryWrite("keys", key_id, rotated.model_dump_json(), expected=text)
        if not await self._write([write], "key.rotate", tenant=record.tenant, key=key_id, name=record.name):
            raise Conflict(f"key '{key_id}' was rotated or revoked by another request meanwhile; read it and retry",
                           param="key_id")
        return rotated, secret

    async def revoke_key(self, key_id: str) -> KeyRecord:
        """Delete the key: the next request with it is a 401 on every replica."""
        for _ in range(ATTEMPTS):
            record, text = await self.key(key_id)
            if await self._write([DirectoryWrite("keys", key_id, None, expected=text)], "key.revoke",
                                 tenant=record.tenant, key=key_id, name=record.name):
                return record
        raise Conflict(f"key '{key_id}' kept changing while it was revoked; retry", param="key_id")


    def _checked(self, data: dict[str, Any]) -> TenantSettings:
        """`data` as a tenant's settings that pass validation and `check`; else a 400 naming the field."""
        try:
            settings = tenant_from_dict(data)
        except ValidationError as exc:
            raise invalid_settings(exc) from exc
        self.check(settings)
        return settings


def _tenant_text(tenants: dict[str, str], tenant_id: str) -> str:
    """The tenant's stored text; NotFound if the Store has no such tenant."""
    if tenant_id not in tenants:
        raise NotFound(f"no tenant '{quoted(tenant_id)}'", param="tenant_id")
    return tenants[tenant_id]


def _readable(tenant_id: str, text: str) -> TenantSettings:
    try:
        return tenant_from_json(text)
    except (ValidationError, ValueError) as exc:
        raise UnreadableRecord(f"tenant '{tenant_id}' was written by another version of the gateway and cannot "
                               "be read here") from exc


def _refuse_key_fields(body: dict[str, Any]) -> None:
    for field in KEY_FIELDS & body.keys():
        raise InvalidRequest("keys are issued through POST /admin/tenants/{id}/keys, not set as settings",
                             param=field)
