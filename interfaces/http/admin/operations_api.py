"""``GET /metrics`` (Prometheus) and the operator dashboard at ``/dashboard``.

``/metrics`` needs no key, as Prometheus scrapers expect: it shows counts and latencies,
never a node's id or name (what a caller would try credentials against), prompts, generated
text or secrets. ``/metrics/nodes`` adds the per-node gauges, by node id and name, for the
admin key (a scraper sends it as its bearer token). The controller binds 127.0.0.1 by
default; when it listens on a LAN address, restrict ``/metrics`` at the firewall or proxy
like any exporter.

The dashboard is static HTML, JavaScript and CSS from ``interfaces/http/admin/static`` (no build
step, nothing fetched from elsewhere; its one library, uPlot, is vendored in
``interfaces/http/admin/static/vendor``). The page holds no secret: it asks the operator for the
admin key, keeps it in ``sessionStorage`` and calls the admin API with it. Its charts read
``GET /api/admin/metrics/history``: the samples :class:`MetricsHistory` takes every
``METRICS_HISTORY_INTERVAL`` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from litestar import Request, Response, get
from litestar.datastructures import CacheControlHeader
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler

from application.job_manager import JobManager
from application.metrics_history import DevicePoint, HistorySources, MetricsHistory, NodePoint
from application.ports import LiveNode
from domain.states import NodeState
from infrastructure.metrics import (
    CONTENT_TYPE,
    ClusterCollector,
    ClusterSources,
    NodeCollector,
    PrometheusMetrics,
)
from infrastructure.tls import is_loopback
from interfaces.grpc.grpc_server import ControlPlaneServicer
from interfaces.http.admin.admin_api import device_views
from interfaces.http.admin.event_feed import EventFeed
from interfaces.http.http_auth import admin_guard
from interfaces.http.http_docs import (
    ADMIN_KEY_ERRORS,
    AgentSetup,
    ApiOperation,
    MetricsHistoryView,
    errors,
    success,
)
from interfaces.http.http_errors import not_running
from interfaces.services import CoreServices, Provided, Services

STATIC_DIR = Path(__file__).with_name("static")
#: Same origin only: the page talks to nothing but this controller.
DASHBOARD_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def install_operations(
    services: CoreServices, loop: asyncio.AbstractEventLoop
) -> tuple[PrometheusMetrics, EventFeed]:
    """Metrics and the live event feed, both fed by the projection follower."""
    metrics = PrometheusMetrics()
    feed = EventFeed()
    services.app.append_observer = metrics.observe_append
    now = services.app.position()  # what is older is history, not news
    metrics.count_after(now)
    feed.bind(loop, after_position=now)
    services.follower.add_event_listener(metrics.on_event)
    services.follower.add_event_listener(feed.on_event)
    return metrics, feed


def cluster_collector(
    services: CoreServices,
    jobs: JobManager,
    feed: EventFeed,
    servicer: ControlPlaneServicer,
    metrics: PrometheusMetrics,
) -> ClusterCollector:
    """The public scrape-time gauges; registers the per-node ones (``/metrics/nodes``) too."""
    collector = ClusterCollector(
        ClusterSources(
            nodes=services.read_model.list_nodes,
            live=services.live.all,
            connected=services.connections.is_connected,
            active_jobs=lambda: len(jobs.runs),
            store_position=lambda: _store_position(services),
            read_model_position=lambda: services.follower.position,
            feed_subscribers=lambda: feed.subscriber_count,
            feed_dropped=lambda: feed.dropped,
            queue_depths=jobs.queue.depths,
            live_local_only=services.live.local_only,
            projection_failing=lambda: bool(services.follower.error),
            projection_skipped=lambda: len(services.follower.skipped),
            agent_messages_rejected=lambda: dict(servicer.rejected),
            http_auth_failures=lambda: dict(services.auth_failures),
            control_refused=lambda: dict(servicer.refused),
            over_budget=lambda: dict(servicer.over_budget),
            stream_overflows=lambda: services.connections.overflows,
        )
    )
    metrics.add_node_collector(NodeCollector(collector.sources, collector))
    return collector


def metrics_history(
    services: CoreServices,
    jobs: JobManager,
    nodes: Callable[[], Sequence[Mapping[str, Any]]],
    metrics: PrometheusMetrics,
) -> MetricsHistory:
    """The dashboard's history, fed by the follower (tokens) and the Prometheus metrics (time
    to first token); :meth:`MetricsHistory.run` samples it."""
    history = MetricsHistory(
        HistorySources(
            queue_depth=lambda: sum(jobs.queue.depths().values()),
            nodes=lambda: node_points(nodes(), services.live.all()),
        ),
        interval=services.settings.metrics_history_interval,
    )
    history.count_after(services.app.position())  # what is older is history, not news
    services.follower.add_event_listener(history.on_event)
    metrics.first_token_observers.append(history.observe_time_to_first_token)
    return history


def node_points(rows: Sequence[Mapping[str, Any]], live: Mapping[str, LiveNode]) -> list[NodePoint]:
    """Each node that may take work now (neither offline nor revoked): its busy slots, CPU use
    and devices' memory, as its latest heartbeat (``live``) tells them."""
    points = []
    for row in rows:
        if row.get("revoked") or row.get("state") == NodeState.OFFLINE.value:
            continue
        beat = live.get(str(row["node_id"]))
        telemetry = beat.telemetry if beat is not None else None
        cpu = (telemetry or {}).get("cpu_percent")
        devices = device_views(dict(row.get("resources") or {}), telemetry)
        points.append(
            NodePoint(
                node_id=str(row["node_id"]),
                name=str(row.get("name") or ""),
                busy_slots=len(row.get("current_jobs") or ()),
                slots=int(row.get("slots") or 0),
                cpu_percent=float(cpu) if cpu is not None else None,
                devices=tuple(
                    DevicePoint(d["name"], d["memory_total_bytes"], d["memory_free_bytes"])
                    for d in devices
                ),
            )
        )
    return points


def _admin_get(
    path: str,
    summary: str,
    responses: dict[int, ResponseSpec],
    *,
    tag: str = "admin",
    media_type: str | None = None,
) -> get:
    """GET ``path`` for the admin key only (documented so: bearer security, ``responses``)."""
    return get(
        path,
        tags=[tag],
        summary=summary,
        media_type=media_type,
        guards=[admin_guard],
        security=[{"BearerAuth": []}],
        operation_class=ApiOperation,
        responses=responses,
    )


@_admin_get(
    "/api/admin/metrics/history",
    "The dashboard's charts: samples of tokens/s, time to first token, queue depth "
    "and each node's slots and device memory (the last hour at the default interval)",
    {
        **success(MetricsHistoryView, "The samples kept, oldest first"),
        **errors(400, *ADMIN_KEY_ERRORS, 503),
    },
)
async def metrics_history_view(
    history: Provided[MetricsHistory | None],
    since: Annotated[
        float,
        Parameter(ge=0, description="Only the samples taken after this unix time (0: all)"),
    ] = 0.0,
) -> dict[str, Any]:
    if history is None:
        raise not_running("the metrics history is not kept on this controller")
    return {
        "object": "list",
        "interval_seconds": history.interval,
        "points": history.points,
        "data": [dataclasses.asdict(s) for s in history.samples(since or None)],
    }


def agent_controller_url(grpc_host: str, grpc_port: int, seen_as: str) -> str:
    """The control channel's address as an agent elsewhere is to dial it (``host:port``):
    where it listens, or, when it listens on every address, the host the operator reached
    this controller at (``seen_as``, the dashboard's own URL)."""
    host = grpc_host.strip("[]")
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = host == ""
    if wildcard:
        host = seen_as.strip("[]") or "127.0.0.1"
    return f"[{host}]:{grpc_port}" if ":" in host else f"{host}:{grpc_port}"


@_admin_get(
    "/api/admin/agent-setup",
    "What an agent needs besides its enrollment token: the control channel's address "
    "and whether it speaks TLS (the dashboard's 'Add a node' command line)",
    {**success(AgentSetup, "The control channel"), **errors(*ADMIN_KEY_ERRORS)},
)
async def agent_setup(svc: Provided[Services], request: Request[Any, Any, Any]) -> dict[str, Any]:
    settings = svc.settings
    port = svc.grpc_port or settings.grpc_port
    return {
        "controller_url": agent_controller_url(
            settings.grpc_host, port, request.url.hostname or ""
        ),
        "tls": not settings.insecure,
        "loopback_only": is_loopback(settings.grpc_host),
        "enrollment_enabled": bool(settings.node_enrollment_secret),
    }


@get(
    "/metrics",
    tags=["operations"],
    summary="Prometheus metrics (text exposition format 0.0.4); no key needed",
    media_type=CONTENT_TYPE,
    security=[],
    operation_class=ApiOperation,
    responses=errors(503),
)
async def metrics(metrics: Provided[PrometheusMetrics | None]) -> Response[bytes]:
    if metrics is None:
        raise not_running("metrics are not enabled on this controller")
    body = await asyncio.to_thread(metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE, headers={"Cache-Control": "no-store"})


@_admin_get(
    "/metrics/nodes",
    "Per-node Prometheus gauges, by node id and name (admin key)",
    errors(*ADMIN_KEY_ERRORS, 503),
    tag="operations",
    media_type=CONTENT_TYPE,
)
async def node_metrics(metrics: Provided[PrometheusMetrics | None]) -> Response[bytes]:
    if metrics is None:
        raise not_running("metrics are not enabled on this controller")
    body = await asyncio.to_thread(metrics.node_exposition)
    return Response(body, media_type=CONTENT_TYPE, headers={"Cache-Control": "no-store"})


@get("/dashboard", include_in_schema=False, media_type="text/html")
async def dashboard() -> Response[bytes]:
    html = await asyncio.to_thread((STATIC_DIR / "dashboard.html").read_bytes)
    return Response(html, media_type="text/html; charset=utf-8", headers=DASHBOARD_HEADERS)


def operations_handlers() -> list[ControllerRouterHandler]:
    """``/metrics``, ``/metrics/nodes``, the dashboard's admin endpoints (history, agent
    setup), ``/dashboard`` and its static files (a fresh router per app)."""
    static = create_static_files_router(
        path="/dashboard/static",
        directories=[STATIC_DIR],
        name="dashboard-static",
        include_in_schema=False,
        cache_control=CacheControlHeader(no_cache=True),
    )
    return [metrics, node_metrics, metrics_history_view, agent_setup, dashboard, static]


def _store_position(services: CoreServices) -> int:
    """The store's position; raises at once (a scrape error) while it is unreachable."""
    services.app.guard.check()
    return services.app.position()
