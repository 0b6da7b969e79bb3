"""Admin API (``ADMIN_API_KEY``) and ``/health``."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Callable
from typing import Annotated, Any
from uuid import UUID

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec.enums import OpenAPIFormat
from litestar.params import JSONBody, Parameter, PathParameter

from application.close_names import suggestion
from application.enrollment import DEFAULT_TOKEN_TTL, MAX_TOKEN_TTL
from application.errors import NotFound
from application.feed_tickets import issue_ticket
from application.node_steering import NodeSteering
from application.version import CONTROLLER_VERSION
from common.contract import PROTOCOL_VERSION
from domain.bounded_text import NODE_NAME_MAX, node_name_problem
from interfaces.http.admin.admin_routes import AdminController
from interfaces.http.http_docs import (
    ADMIN_KEY_ERRORS,
    AccessRefusals,
    ApiOperation,
    EnrollmentToken,
    FeedTicket,
    Health,
    IssuedTokenRow,
    IssuedTokens,
    NodeView,
    NodeViews,
    errors,
    success,
)
from interfaces.http.http_errors import ApiError, ErrorCode, not_found, not_running
from interfaces.services import Provided, Services

READ_YOUR_WRITES_TIMEOUT = 5.0
#: Seconds a client of a degraded controller should wait before asking again.
HEALTH_RETRY_AFTER = 2

#: An id as the API gives it out (a hyphenated UUID, any case).
UUID_PATTERN = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_UUID = re.compile(UUID_PATTERN)
#: A node's id (a UUID); anything else names no node (404, without asking the store).
NodeId = Annotated[str, PathParameter(format=OpenAPIFormat.UUID, description="The node's id")]


def node_view(svc: Services, row: dict[str, Any], now: float) -> dict[str, Any]:
    """A node's read-model row plus what the latest heartbeat says."""
    live = svc.live.get(row["node_id"])
    view = dict(row)
    view.pop("inventory", None)
    view["transfer_failures"] = row.get("transfer_failures") or []  # older rows lack it
    view["connected"] = svc.connections.is_connected(row["node_id"])
    view["heartbeat_age_seconds"] = round(now - live.last_seen, 3) if live else None
    view["telemetry"] = live.telemetry if live else None
    resources = row.get("resources") or {}
    view["devices"] = device_views(resources, live.telemetry if live else None)
    view["llama"] = {
        "version": str(resources.get("llama_version") or ""),
        "backend": str(resources.get("llama_backend") or ""),
        "rpc_protocol": str(resources.get("rpc_protocol") or ""),
    }
    return view


def device_views(
    resources: dict[str, Any], telemetry: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The node's devices as last reported, each with its free memory from the latest
    heartbeat where that names it."""
    live: dict[str, int] = {}
    for sample in (telemetry or {}).get("devices") or []:
        if isinstance(sample, dict) and sample.get("name"):
            live[str(sample["name"])] = int(sample.get("memory_free_bytes") or 0)
    views = []
    for device in resources.get("devices") or []:
        if not isinstance(device, dict):
            continue
        name = str(device.get("name") or "")
        views.append(
            {
                "name": name,
                "description": str(device.get("description") or ""),
                "kind": str(device.get("kind") or ""),
                "memory_total_bytes": int(device.get("memory_total_bytes") or 0),
                "memory_free_bytes": live.get(name, int(device.get("memory_free_bytes") or 0)),
                "uuid": str(device.get("uuid") or ""),
            }
        )
    return views


def node_not_found(node_id: str) -> ApiError:
    return not_found(f"unknown node {node_id}", ErrorCode.NODE_NOT_FOUND)


def canonical_id(ident: str, error: ApiError) -> str:
    """``ident`` as the views key it (a UUID's lowercase text), or raises ``error``.

    Only the hyphenated form is an id (what the API returns and its schema calls a ``uuid``);
    anything else never reaches the store (a NUL byte breaks a Postgres query)."""
    if not _UUID.fullmatch(ident):
        raise error
    return str(UUID(ident))


#: A token's node name that Enroll would refuse (letters, digits and ``._-``: no pattern in the
#: schema says "any script's letters").
INVALID_NODE_NAME = ErrorCode.INVALID_NODE_NAME


class EnrollmentTokenRequest(msgspec.Struct):
    ttl_seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_TOKEN_TTL)] = DEFAULT_TOKEN_TTL
    #: One enrollment only, unless multi-use is asked for explicitly (``false``).
    single_use: bool = True
    #: Binds the token to the agent enrolling under exactly this name (none: any name).
    node_name: Annotated[str, msgspec.Meta(min_length=1, max_length=NODE_NAME_MAX)] | None = None


#: A token id as minted (``secrets.token_hex``); anything else names no token.
_TOKEN_ID = re.compile(r"[0-9a-f]{1,64}")
TokenId = Annotated[
    str,
    PathParameter(pattern=f"^{_TOKEN_ID.pattern}$", description="The token's id (`token_id`)"),
]


def token_not_found(token_id: str, hint: str = "") -> ApiError:
    """404 for the unknown token ``token_id`` (``hint``: the closest known ids)."""
    return not_found(f"unknown enrollment token {token_id!r}{hint}", ErrorCode.TOKEN_NOT_FOUND)


class RevokeRequest(msgspec.Struct):
    #: Why, for the record (NODE_REVOKED's ``reason``).
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=500)] = (
        "revoked by an administrator"
    )


class AdminRoutes(AdminController):
    path = "/api/admin"

    @get(
        "/nodes",
        summary="List enrolled nodes with state, resources and heartbeat age",
        operation_class=ApiOperation,
        responses={**success(NodeViews, "Every node"), **errors(*ADMIN_KEY_ERRORS, 503)},
    )
    async def list_nodes(self, svc: Provided[Services]) -> dict[str, Any]:
        rows = await asyncio.to_thread(svc.read_model.list_nodes)
        now = time.time()
        return {"object": "list", "data": [node_view(svc, r, now) for r in rows]}

    @get(
        "/access-refusals",
        summary="Refused enrollments and control streams, newest first (ACCESS_REFUSED)",
        operation_class=ApiOperation,
        responses={
            **success(AccessRefusals, "The most recent refusals"),
            **errors(400, *ADMIN_KEY_ERRORS, 503),
        },
    )
    async def access_refusals(
        self,
        svc: Provided[Services],
        limit: Annotated[int, Parameter(ge=1, le=500, description="How many")] = 50,
    ) -> dict[str, Any]:
        rows = await asyncio.to_thread(svc.read_model.list_refusals, limit=limit)
        return {"object": "list", "data": rows}

    @get(
        "/nodes/{node_id:str}",
        summary="One node",
        operation_class=ApiOperation,
        responses={
            **success(NodeView, "The node, with its inventory"),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown node"), 503),
        },
    )
    async def get_node(self, svc: Provided[Services], node_id: NodeId) -> dict[str, Any]:
        key = canonical_id(node_id, node_not_found(node_id))
        row = await asyncio.to_thread(svc.read_model.get_node, key)
        if row is None:
            raise node_not_found(node_id)
        view = node_view(svc, row, time.time())
        view["inventory"] = row.get("inventory")
        return view

    async def _steer(
        self,
        svc: Services,
        steering: NodeSteering | None,
        ident: str,
        command: Callable[[NodeSteering, str], int],
    ) -> dict[str, Any]:
        """Runs ``command`` (a :class:`NodeSteering` use case) on the node ``ident`` names, and
        answers the node as the views show it once they hold what the command recorded."""
        node_id = canonical_id(ident, node_not_found(ident))
        if await asyncio.to_thread(svc.read_model.get_node, node_id) is None:
            raise node_not_found(ident)
        if steering is None:
            raise not_running("node steering is not running")
        position = await asyncio.to_thread(command, steering, node_id)
        await asyncio.to_thread(svc.follower.wait, position, READ_YOUR_WRITES_TIMEOUT)
        row = await asyncio.to_thread(svc.read_model.get_node, node_id)
        assert row is not None
        return node_view(svc, row, time.time())

    @post(
        "/nodes/{node_id:str}/drain",
        status_code=202,
        summary="Stop assigning work; NODE_DRAINED once its jobs end",
        operation_class=ApiOperation,
        responses={
            **success(NodeView, "The node, drain requested", 202),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown node"), 409, 503),
        },
    )
    async def drain(
        self, svc: Provided[Services], steering: Provided[NodeSteering | None], node_id: NodeId
    ) -> dict[str, Any]:
        return await self._steer(svc, steering, node_id, lambda s, n: s.drain(n, "admin-api"))

    @post(
        "/nodes/{node_id:str}/resume",
        status_code=200,
        summary="Accept work again",
        operation_class=ApiOperation,
        responses={
            **success(NodeView, "The node, accepting work"),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown node"), 409, 503),
        },
    )
    async def resume(
        self, svc: Provided[Services], steering: Provided[NodeSteering | None], node_id: NodeId
    ) -> dict[str, Any]:
        return await self._steer(svc, steering, node_id, lambda s, n: s.resume(n, "admin-api"))

    @post(
        "/nodes/{node_id:str}/revoke",
        status_code=200,
        summary="Revoke a node: its credential is void, its stream closed, its jobs fail",
        operation_class=ApiOperation,
        responses={
            **success(NodeView, "The node, revoked (OFFLINE for good)"),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown node"), (409, "Already revoked"), 503),
        },
    )
    async def revoke(
        self,
        svc: Provided[Services],
        steering: Provided[NodeSteering | None],
        node_id: NodeId,
        data: JSONBody[RevokeRequest | None] = None,
    ) -> dict[str, Any]:
        reason = (data or RevokeRequest()).reason
        return await self._steer(
            svc, steering, node_id, lambda s, n: s.revoke(n, reason, "admin-api")
        )

    @get(
        "/enrollment-tokens",
        summary="Enrollment tokens minted through dacp, newest first (the tokens themselves "
        "are not kept)",
        operation_class=ApiOperation,
        responses={
            **success(IssuedTokens, "The tokens' ids and terms"),
            **errors(400, *ADMIN_KEY_ERRORS, 503),
        },
    )
    async def list_tokens(
        self,
        svc: Provided[Services],
        limit: Annotated[int, Parameter(ge=1, le=1000, description="How many")] = 100,
    ) -> dict[str, Any]:
        rows = await asyncio.to_thread(svc.read_model.list_tokens, limit)
        return {"object": "list", "data": rows}

    @post(
        "/enrollment-tokens/{token_id:str}/revoke",
        status_code=200,
        summary="Revoke an enrollment token: no enrollment with it from now on",
        operation_class=ApiOperation,
        responses={
            **success(IssuedTokenRow, "The token, revoked"),
            **errors(400, *ADMIN_KEY_ERRORS, (404, "Unknown token"), (409, "Already revoked"), 503),
        },
    )
    async def revoke_token(self, svc: Provided[Services], token_id: TokenId) -> dict[str, Any]:
        if not _TOKEN_ID.fullmatch(token_id):
            raise token_not_found(token_id)
        try:
            position = await asyncio.to_thread(
                svc.app.revoke_token, token_id, "admin-api", "revoked by an administrator"
            )
        except NotFound:
            minted = await asyncio.to_thread(svc.read_model.list_tokens, 1000)
            ids = [str(r["token_id"]) for r in minted]
            hint = suggestion("enrollment token", token_id, ids)
            raise token_not_found(token_id, hint) from None
        await asyncio.to_thread(svc.follower.wait, position, READ_YOUR_WRITES_TIMEOUT)
        rows = await asyncio.to_thread(svc.read_model.list_tokens, 1000)
        row = next((r for r in rows if r["token_id"] == token_id), None)
        if row is None:
            raise token_not_found(token_id)
        return row

    @post(
        "/feed-tickets",
        status_code=201,
        summary="A ticket that opens the live event feed for 60 s (?ticket=): no key in URLs",
        description=(
            "The feed it opens ends at `session_ends_at` (FEED_SESSION_SECONDS from now): mint"
            " a new ticket, with the key in the header, to go on."
        ),
        operation_class=ApiOperation,
        responses={
            **success(FeedTicket, "The ticket and when it expires (unix seconds)", 201),
            **errors(*ADMIN_KEY_ERRORS),
        },
    )
    async def feed_ticket(self, svc: Provided[Services]) -> dict[str, Any]:
        settings = svc.settings
        assert settings.admin_api_key  # the admin guard let the request in
        minted = issue_ticket(
            settings.admin_api_key, time.time(), session_seconds=settings.feed_session_seconds
        )
        return {
            "ticket": minted.ticket,
            "expires_at": minted.expires_at,
            "session_ends_at": minted.session_ends_at,
        }

    @post(
        "/enrollment-tokens",
        status_code=201,
        summary="Mint an enrollment token",
        operation_class=ApiOperation,
        responses={
            **success(EnrollmentToken, "The token; it is not stored anywhere", 201),
            **errors(
                400,
                *ADMIN_KEY_ERRORS,
                (409, "Enrollment is disabled (no `NODE_ENROLLMENT_SECRET`)"),
            ),
        },
    )
    async def mint_token(
        self, svc: Provided[Services], data: JSONBody[EnrollmentTokenRequest | None] = None
    ) -> dict[str, Any]:
        req = data or EnrollmentTokenRequest()
        if not svc.settings.node_enrollment_secret:
            raise ApiError(
                409,
                "NODE_ENROLLMENT_SECRET is not set on the controller",
                type_="conflict",
                code=ErrorCode.ENROLLMENT_DISABLED,
            )
        problem = node_name_problem(req.node_name) if req.node_name else None
        if problem is not None:
            raise ApiError(400, problem, param="node_name", code=INVALID_NODE_NAME)
        minted = await asyncio.to_thread(
            functools.partial(
                svc.enrollment.mint,
                ttl_seconds=req.ttl_seconds,
                single_use=req.single_use,
                node_name=req.node_name,
                now=time.time(),
            )
        )
        # Read your writes: the token is in GET /api/admin/enrollment-tokens once this returns.
        await asyncio.to_thread(svc.follower.wait, svc.app.position(), READ_YOUR_WRITES_TIMEOUT)
        return {
            "token": minted.token,
            "token_id": minted.token_id,
            "expires_at": minted.expires_at,
            "single_use": minted.single_use,
            "node_name": minted.node_name,
        }


@get(
    "/health",
    summary="Controller health (503 when the store or live state is down)",
    tags=["health"],
    operation_class=ApiOperation,
    responses={
        **success(Health, "Healthy"),
        503: ResponseSpec(
            data_container=Health,
            description="Degraded: the store or live state is unreachable, or the views fail",
            generate_examples=False,
        ),
    },
)
async def health(
    svc: Provided[Services], request: Request[Any, Any, Any]
) -> Response[dict[str, Any]]:

    def store_position() -> int | None:
        if not svc.app.guard.up:
            return None  # known unreachable: no wait for the pool
        try:
            return svc.app.position()
        except Exception:
            return None

    position = await asyncio.to_thread(store_position)
    store = position is not None
    live = await asyncio.to_thread(svc.live.ping)
    follower = svc.follower
    healthy = store and live and not follower.error
    return Response(
        {
            "status": "ok" if healthy else "degraded",
            "store": store,
            "live_state": live,
            "store_kind": "postgres" if follower.uses_subscription else "sqlite",
            "read_model_position": follower.position,
            "read_model_lag": None if position is None else max(0, position - follower.position),
            "projection_error": follower.error or None,
            "projection_skipped_events": list(follower.skipped),
            "controller_version": CONTROLLER_VERSION,
            "protocol": PROTOCOL_VERSION,
            "connected_nodes": len(svc.connections.connected()),
        },
        status_code=200 if healthy else 503,
        headers=None if healthy else {"Retry-After": str(HEALTH_RETRY_AFTER)},
    )
