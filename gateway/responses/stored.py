"""Stored responses (`store: true`): each tenant's Responses with the conversation they close, in
the gateway's store (Redis across replicas) for `store.responses_ttl_s`. A tenant reads only its own,
and keeps at most `store.responses_max_per_tenant` of them, `store.responses_max_bytes_per_tenant`
bytes in all."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from adapters.store import ResponseQuota, Store, StoreUnavailable
from gateway.wire.errors import GatewayError, quoted

log = logging.getLogger("gateway.responses")


class ResponseNotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "not_found"


class StoreDown(GatewayError):
    status, type, code = 503, "server_error", "store_unavailable"


@dataclass(frozen=True)
class StoredResponses:
    store: Store
    ttl_s: float
    quota: ResponseQuota | None = None

    async def put(self, tenant: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep `response` and its conversation (chat messages, instructions excluded). When it
        cannot be kept (the tenant is at its quota, the store is near full or down) the answer
        still goes out, saying `store: false` (`response` is changed so), and False is returned.

        Answering unstored rather than refusing: `store` defaults to true, so clients that never
        continue a stored response (most of them) keep working at the quota; a client that does
        sees `store: false` on the response it would continue."""
        value = json.dumps({"response": response, "conversation": conversation}, ensure_ascii=False)
        try:
            await self.store.response_put(tenant, response["id"], value, self.ttl_s, self.quota)
        except StoreUnavailable as exc:
            log.warning("response %s not stored: %s", response["id"], exc)
            response["store"] = False
            return False
        return True

    async def get(self, tenant: str, response_id: str, param: str | None = None) -> dict[str, Any]:
        """{"response": ..., "conversation": [...]}; 404 when the tenant has no such response."""
        try:
            value = await self.store.response_get(tenant, response_id)
        except StoreUnavailable as exc:
            raise StoreDown("stored responses are unreachable; retry shortly") from exc
        if value is None:
            error = ResponseNotFound(f"No response found with id '{quoted(response_id)}'.", param=param)
            if param == "previous_response_id":
                error.code = "previous_response_not_found"
            raise error
        return json.loads(value)

    async def delete(self, tenant: str, response_id: str) -> None:
        try:
            deleted = await self.store.response_delete(tenant, response_id)
        except StoreUnavailable as exc:
            raise StoreDown("stored responses are unreachable; retry shortly") from exc
        if not deleted:
            raise ResponseNotFound(f"No response found with id '{quoted(response_id)}'.")
