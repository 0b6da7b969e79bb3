"""Admin API of managed inference keys (issue 25): ``/api/admin/api-keys``.

``POST`` creates a key and answers its text once (it is kept nowhere: the store holds its
sha256, the views not even that); ``GET`` lists them or shows one; ``PATCH`` changes a key's
terms (only the fields sent; ``null`` models: every model, ``null`` expires_at: never);
``POST …/revoke`` ends a key for good, on every controller sharing the store at once. The
key book itself is :class:`application.api_keys.KeyBook`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec
from litestar import get, patch, post
from litestar.openapi.spec import OpenAPIType, Schema
from litestar.openapi.spec.enums import OpenAPIFormat
from litestar.params import JSONBody, PathParameter

from application.api_keys import KeyBook, is_live
from application.errors import NotFound
from domain.api_key import (
    KEY_LIMIT_MAX,
    KEY_MODELS_MAX,
    KEY_NAME_MAX,
    KEY_NAME_PATTERN,
    KEY_OWNER_PATTERN,
    KeyChanges,
)
from domain.api_keys import KeyLimits, Priority
from domain.model import MODEL_NAME_PATTERN, is_model_name
from interfaces.http.admin.admin_api import READ_YOUR_WRITES_TIMEOUT, RevokeRequest, canonical_id
from interfaces.http.admin.admin_routes import AdminController
from interfaces.http.http_docs import (
    ADMIN_KEY_ERRORS,
    ApiKeyRow,
    ApiKeys,
    ApiOperation,
    NewApiKey,
    errors,
    success,
)
from interfaces.http.http_errors import ApiError, ErrorCode, not_found
from interfaces.services import Provided, Services

#: Who the admin API records as revoking a key.
REVOKED_BY = "admin-api"

Limit = Annotated[int, msgspec.Meta(ge=1, le=KEY_LIMIT_MAX)] | None
Name = Annotated[str, msgspec.Meta(pattern=KEY_NAME_PATTERN, max_length=KEY_NAME_MAX)]
Owner = Annotated[str, msgspec.Meta(pattern=KEY_OWNER_PATTERN, max_length=KEY_NAME_MAX)]
#: Model names, each of MODEL_NAME_PATTERN: the schema says so (Litestar leaves out the pattern
#: of a list's items, so it is given here) and the domain checks it (400 ``invalid_command``).
Models = Annotated[
    list[str],
    msgspec.Meta(
        min_length=1,
        max_length=KEY_MODELS_MAX,
        extra_json_schema={
            "extra": {"items": Schema(type=OpenAPIType.STRING, pattern=MODEL_NAME_PATTERN)}
        },
    ),
]
Expiry = Annotated[datetime, msgspec.Meta(tz=True)]
#: A key's id (a UUID); anything else names no key (404, without asking the store).
KeyId = Annotated[str, PathParameter(format=OpenAPIFormat.UUID, description="The key's id")]


class LimitsBody(msgspec.Struct):
    """A key's limits; a limit left out or null is no limit."""

    requests_per_minute: Limit = None
    tokens_per_minute: Limit = None
    concurrent_requests: Limit = None
    monthly_tokens: Limit = None

    def limits(self) -> KeyLimits:
        return KeyLimits(
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            concurrent_requests=self.concurrent_requests,
            monthly_tokens=self.monthly_tokens,
        )


class KeyCreation(msgspec.Struct):
    """A new key: only ``name`` is needed (then: every model, no limits, interactive, no
    expiry)."""

    name: Name
    owner: Owner = ""
    #: The models the key may use; null or left out: every model.
    models: Models | None = None
    limits: LimitsBody | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    #: When the key stops working (RFC 3339 with its zone); null: never.
    expires_at: Expiry | None = None


class KeyChange(msgspec.Struct):
    """The terms to change; a field left out stays as it is. ``limits`` replaces all four
    limits (one left out: no limit)."""

    name: Name | msgspec.UnsetType = msgspec.UNSET
    owner: Owner | msgspec.UnsetType = msgspec.UNSET
    models: Models | msgspec.UnsetType | None = msgspec.UNSET
    limits: LimitsBody | msgspec.UnsetType = msgspec.UNSET
    priority: Literal["interactive", "batch"] | msgspec.UnsetType = msgspec.UNSET
    expires_at: Expiry | msgspec.UnsetType | None = msgspec.UNSET

    def changes(self) -> KeyChanges:
        out = KeyChanges()
        if not isinstance(self.name, msgspec.UnsetType):
            out["name"] = self.name
        if not isinstance(self.owner, msgspec.UnsetType):
            out["owner"] = self.owner
        if not isinstance(self.models, msgspec.UnsetType):
            out["models"] = _checked(self.models)
        if not isinstance(self.limits, msgspec.UnsetType):
            out["limits"] = self.limits.limits()
        if not isinstance(self.priority, msgspec.UnsetType):
            out["priority"] = Priority(self.priority)
        if not isinstance(self.expires_at, msgspec.UnsetType):
            out["expires_at"] = self.expires_at
        return out


def _checked(models: list[str] | None) -> list[str] | None:
    """``models``, or 400 (param ``models``) for one that no model can be named."""
    for name in models or []:
        if not is_model_name(name):
            raise ApiError(
                400,
                f"models: {name[:80]!r} is not a model name ({MODEL_NAME_PATTERN})",
                param="models",
                code=ErrorCode.INVALID_VALUE,
            )
    return models


def key_not_found(key_id: str) -> ApiError:
    return not_found(f"unknown API key {key_id}", ErrorCode.API_KEY_NOT_FOUND)


def key_view(row: dict[str, Any], now: datetime) -> dict[str, Any]:
    """A key's views row, and whether it works now (``active``)."""
    return {**row, "active": is_live(row, now)}


async def _view(svc: Services, key_id: str, position: int) -> dict[str, Any]:
    """The key as the views hold it once they reached ``position`` (read your writes)."""
    await asyncio.to_thread(svc.follower.wait, position, READ_YOUR_WRITES_TIMEOUT)
    row = await asyncio.to_thread(svc.keys.get, key_id)
    if row is None:
        raise key_not_found(key_id)
    return key_view(row, datetime.now(UTC))


async def _command(
    svc: Services, ident: str, command: Callable[[KeyBook, str], int]
) -> dict[str, Any]:
    """Runs ``command`` on the key ``ident`` names and answers the key as it is then."""
    key_id = canonical_id(ident, key_not_found(ident))
    try:
        position = await asyncio.to_thread(command, svc.keys, key_id)
    except NotFound:
        raise key_not_found(ident) from None
    return await _view(svc, key_id, position)


class AdminApiKeyRoutes(AdminController):
    path = "/api/admin/api-keys"

    @post(
        "/",
        status_code=201,
        summary="Create an inference API key (its text is answered once, never again)",
        operation_class=ApiOperation,
        responses={
            **success(NewApiKey, "The key's text (`key`) and terms", 201),
            **errors(400, *ADMIN_KEY_ERRORS, 503),
        },
    )
    async def create(self, svc: Provided[Services], data: JSONBody[KeyCreation]) -> dict[str, Any]:
        limits = data.limits.limits() if data.limits is not None else KeyLimits()
        new = await asyncio.to_thread(
            lambda: svc.keys.create(
                data.name,
                owner=data.owner,
                models=_checked(data.models),
                limits=limits,
                priority=Priority(data.priority),
                expires_at=data.expires_at,
            )
        )
        view = await _view(svc, new.key_id, new.position)
        return {**view, "key": new.key}

    @get(
        "/",
        summary="Inference API keys, newest first (never their text)",
        operation_class=ApiOperation,
        responses={**success(ApiKeys, "Every key"), **errors(*ADMIN_KEY_ERRORS, 503)},
    )
    async def list_keys(self, svc: Provided[Services]) -> dict[str, Any]:
        rows = await asyncio.to_thread(svc.keys.list)
        now = datetime.now(UTC)
        return {"object": "list", "data": [key_view(row, now) for row in rows]}

    @get(
        "/{key_id:str}",
        summary="One inference API key",
        operation_class=ApiOperation,
        responses={
            **success(ApiKeyRow, "The key"),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown key (`api_key_not_found`)"), 503),
        },
    )
    async def get_key(self, svc: Provided[Services], key_id: KeyId) -> dict[str, Any]:
        ident = canonical_id(key_id, key_not_found(key_id))
        row = await asyncio.to_thread(svc.keys.get, ident)
        if row is None:
            raise key_not_found(key_id)
        return key_view(row, datetime.now(UTC))

    @patch(
        "/{key_id:str}",
        summary="Change a key's terms (the fields sent)",
        operation_class=ApiOperation,
        responses={
            **success(ApiKeyRow, "The key, changed"),
            **errors(
                400,
                *ADMIN_KEY_ERRORS,
                (404, "Unknown key (`api_key_not_found`)"),
                (409, "The key is revoked (`illegal_transition`)"),
                503,
            ),
        },
    )
    async def change(
        self, svc: Provided[Services], key_id: KeyId, data: JSONBody[KeyChange]
    ) -> dict[str, Any]:
        changes = data.changes()
        return await _command(svc, key_id, lambda keys, ident: keys.change(ident, changes))

    @post(
        "/{key_id:str}/revoke",
        status_code=200,
        summary="Revoke a key: it fails at once, on every controller",
        operation_class=ApiOperation,
        responses={
            **success(ApiKeyRow, "The key, revoked"),
            **errors(
                400,
                *ADMIN_KEY_ERRORS,
                (404, "Unknown key (`api_key_not_found`)"),
                (409, "Already revoked (`illegal_transition`)"),
                503,
            ),
        },
    )
    async def revoke(
        self,
        svc: Provided[Services],
        key_id: KeyId,
        data: JSONBody[RevokeRequest | None] = None,
    ) -> dict[str, Any]:
        reason = (data or RevokeRequest()).reason
        return await _command(
            svc, key_id, lambda keys, ident: keys.revoke(ident, reason, REVOKED_BY)
        )
