"""Admin API (``ADMIN_API_KEY``) and ``/health``."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from litestar import Controller as Routes
from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.params import FromPath, JSONBody

from application.version import CONTROLLER_VERSION
from interfaces.http_auth import admin_guard
from interfaces.http_errors import ApiError
from interfaces.services import Services
from proto import PROTOCOL_VERSION

READ_YOUR_WRITES_TIMEOUT = 5.0


def services(state: State) -> Services:
    return state.services  # type: ignore[no-any-return]


def node_view(svc: Services, row: dict[str, Any], now: float) -> dict[str, Any]:
    """A node's read-model row plus what the latest heartbeat says."""
    live = svc.live.get(row["node_id"])
    view = dict(row)
    view.pop("inventory", None)
    view["connected"] = svc.connections.is_connected(row["node_id"])
    view["heartbeat_age_seconds"] = round(now - live.last_seen, 3) if live else None
    view["telemetry"] = live.telemetry if live else None
    return view


@dataclass
class EnrollmentTokenRequest:
    ttl_seconds: float = 3600.0
    single_use: bool = False
    node_name: str | None = None


class AdminRoutes(Routes):
    path = "/api/admin"
    guards = [admin_guard]
    tags = ["admin"]
    security = [{"BearerAuth": []}]

    @get("/nodes", summary="List enrolled nodes with state, resources and heartbeat age")
    async def list_nodes(self, state: State) -> dict[str, Any]:
        svc = services(state)
        rows = await asyncio.to_thread(svc.read_model.list_nodes)
        now = time.time()
        return {"object": "list", "data": [node_view(svc, r, now) for r in rows]}

    @get("/nodes/{node_id:str}", summary="One node")
    async def get_node(self, state: State, node_id: FromPath[str]) -> dict[str, Any]:
        svc = services(state)
        row = await asyncio.to_thread(svc.read_model.get_node, node_id)
        if row is None:
            raise ApiError(
                404, f"unknown node {node_id}", type_="not_found_error", code="node_not_found"
            )
        view = node_view(svc, row, time.time())
        view["inventory"] = row.get("inventory")
        return view

    async def _steer(self, svc: Services, node_id: str, command: str, who: str) -> dict[str, Any]:
        if await asyncio.to_thread(svc.read_model.get_node, node_id) is None:
            raise ApiError(
                404, f"unknown node {node_id}", type_="not_found_error", code="node_not_found"
            )
        fn = svc.app.request_drain if command == "drain" else svc.app.resume
        position = await asyncio.to_thread(fn, node_id, who)
        await asyncio.to_thread(svc.follower.wait, position, READ_YOUR_WRITES_TIMEOUT)
        from proto import control_pb2 as pb

        message = (
            pb.ControllerMessage(drain=pb.Drain())
            if command == "drain"
            else (pb.ControllerMessage(resume=pb.Resume()))
        )
        svc.connections.send(node_id, message)
        row = await asyncio.to_thread(svc.read_model.get_node, node_id)
        assert row is not None
        return node_view(svc, row, time.time())

    @post(
        "/nodes/{node_id:str}/drain",
        status_code=202,
        summary="Stop assigning work; NODE_DRAINED once its jobs end",
    )
    async def drain(self, state: State, node_id: FromPath[str]) -> dict[str, Any]:
        return await self._steer(services(state), node_id, "drain", "admin-api")

    @post("/nodes/{node_id:str}/resume", status_code=200, summary="Accept work again")
    async def resume(self, state: State, node_id: FromPath[str]) -> dict[str, Any]:
        return await self._steer(services(state), node_id, "resume", "admin-api")

    @post("/enrollment-tokens", status_code=201, summary="Mint an enrollment token")
    async def mint_token(
        self, state: State, data: JSONBody[EnrollmentTokenRequest | None] = None
    ) -> dict[str, Any]:
        svc = services(state)
        req = data or EnrollmentTokenRequest()
        if not 0 < req.ttl_seconds <= 366 * 24 * 3600:
            raise ApiError(400, "ttl_seconds must be between 0 and one year", param="ttl_seconds")
        if not svc.settings.node_enrollment_secret:
            raise ApiError(
                409,
                "NODE_ENROLLMENT_SECRET is not set on the controller",
                type_="conflict",
                code="enrollment_disabled",
            )
        minted = svc.enrollment.mint(
            ttl_seconds=req.ttl_seconds,
            single_use=req.single_use,
            node_name=req.node_name,
            now=time.time(),
        )
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
)
async def health(state: State, request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    svc = services(state)

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
    )
