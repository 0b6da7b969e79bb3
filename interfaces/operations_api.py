"""``GET /metrics`` (Prometheus) and the operator dashboard at ``/dashboard``.

``/metrics`` needs no key, as Prometheus scrapers expect: it shows counts and latencies,
never a node's id or name (what a caller would try credentials against), prompts, generated
text or secrets. ``/metrics/nodes`` adds the per-node gauges, by node id and name, for the
admin key (a scraper sends it as its bearer token). The controller binds 127.0.0.1 by
default; when it listens on a LAN address, restrict ``/metrics`` at the firewall or proxy
like any exporter.

The dashboard is static HTML, JavaScript and CSS from ``interfaces/static`` (no build step,
nothing fetched from elsewhere). The page holds no secret: it asks the operator for the
admin key, keeps it in ``sessionStorage`` and calls the admin API with it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from litestar import Response, get
from litestar.datastructures import CacheControlHeader, State
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler

from application.job_manager import JobManager
from infrastructure.metrics import (
    CONTENT_TYPE,
    ClusterCollector,
    ClusterSources,
    NodeCollector,
    PrometheusMetrics,
)
from interfaces.event_feed import EventFeed
from interfaces.grpc_server import ControlPlaneServicer
from interfaces.http_auth import admin_guard
from interfaces.http_docs import ADMIN_KEY_ERRORS, ApiOperation, errors
from interfaces.http_errors import not_running
from interfaces.services import Services

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
    services: Services, loop: asyncio.AbstractEventLoop
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
    services.extras["metrics"] = metrics
    services.extras["feed"] = feed
    return metrics, feed


def cluster_collector(
    services: Services, jobs: JobManager, feed: EventFeed, servicer: ControlPlaneServicer
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
    metrics = services.extras.get("metrics")
    if isinstance(metrics, PrometheusMetrics):
        metrics.add_node_collector(NodeCollector(collector.sources, collector))
    return collector


@get(
    "/metrics",
    tags=["operations"],
    summary="Prometheus metrics (text exposition format 0.0.4); no key needed",
    media_type=CONTENT_TYPE,
    security=[],
    operation_class=ApiOperation,
    responses=errors(503),
)
async def metrics(state: State) -> Response[bytes]:
    svc: Services = state.services
    registry = svc.extras.get("metrics")
    if not isinstance(registry, PrometheusMetrics):
        raise not_running("metrics are not enabled on this controller")
    body = await asyncio.to_thread(registry.exposition)
    return Response(body, media_type=CONTENT_TYPE, headers={"Cache-Control": "no-store"})


@get(
    "/metrics/nodes",
    tags=["operations"],
    summary="Per-node Prometheus gauges, by node id and name (admin key)",
    media_type=CONTENT_TYPE,
    guards=[admin_guard],
    security=[{"BearerAuth": []}],
    operation_class=ApiOperation,
    responses=errors(*ADMIN_KEY_ERRORS, 503),
)
async def node_metrics(state: State) -> Response[bytes]:
    svc: Services = state.services
    registry = svc.extras.get("metrics")
    if not isinstance(registry, PrometheusMetrics):
        raise not_running("metrics are not enabled on this controller")
    body = await asyncio.to_thread(registry.node_exposition)
    return Response(body, media_type=CONTENT_TYPE, headers={"Cache-Control": "no-store"})


@get("/dashboard", include_in_schema=False, media_type="text/html")
async def dashboard() -> Response[bytes]:
    html = await asyncio.to_thread((STATIC_DIR / "dashboard.html").read_bytes)
    return Response(html, media_type="text/html; charset=utf-8", headers=DASHBOARD_HEADERS)


def operations_handlers() -> list[ControllerRouterHandler]:
    """``/metrics``, ``/metrics/nodes``, ``/dashboard`` and its static files (a fresh router
    per app)."""
    static = create_static_files_router(
        path="/dashboard/static",
        directories=[STATIC_DIR],
        name="dashboard-static",
        include_in_schema=False,
        cache_control=CacheControlHeader(no_cache=True),
    )
    return [metrics, node_metrics, dashboard, static]


def _store_position(services: Services) -> int:
    """The store's position; raises at once (a scrape error) while it is unreachable."""
    services.app.guard.check()
    return services.app.position()
