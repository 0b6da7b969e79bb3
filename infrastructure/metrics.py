"""Prometheus metrics for the controller (``GET /metrics``).

Three kinds of figures, each from where it is cheapest and truest:

* latency histograms observed on the hot paths through the application's ``Metrics`` port
  (time to first token, inter-token latency, event-store append latency);
* counters moved by the projection follower's event listener, once per applied event
  (jobs by terminal state, failures by phase, tokens generated, events by catalog code;
  requests and tokens by API key and model, ``infrastructure/key_usage_metrics.py``);
* gauges collected at scrape time (nodes by state from the read model, nodes connected,
  jobs active on this controller, store positions).

``GET /metrics`` needs no key, so it names no node: a node's id is what a caller needs to try
credentials against it. The per-node gauges (heartbeat age and connection, by node id and
name) are a second registry, :attr:`PrometheusMetrics.nodes`, served at ``GET /metrics/nodes``
with the admin key.

Every controller owns its own ``CollectorRegistry``: several controllers can share one
process (the tests do), and nothing lands in the global default registry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from application.ports import LiveNode
from domain.catalog import code_of
from domain.states import NodeState
from infrastructure.key_usage_metrics import KeyUsageCounters
from infrastructure.loop_histogram import LoopHistogram

log = logging.getLogger(__name__)

#: The classic text exposition format, understood by every Prometheus version.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: The results of a prefix route (``application/prefix_routing.py``), the only labels of
#: ``dacp_prefix_routes_total``.
ROUTE_RESULTS = ("hit", "miss")

TERMINAL_CODES = {
    "JOB_COMPLETED": "COMPLETED",
    "JOB_FAILED": "FAILED",
    "JOB_CANCELLED": "CANCELLED",
    "JOB_REJECTED": "REJECTED",
}


class PrometheusMetrics:
    """Implements :class:`application.ports.Metrics`, plus the event-driven counters."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        #: The per-node gauges (node ids and names): the admin key's view only.
        self.nodes = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "dacp_time_to_first_token_seconds",
            "Time from job submission to the first token relayed to the client.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        # Observed for every relayed token message, by the event loop alone: lock-free.
        self.inter_token = LoopHistogram(
            "dacp_inter_token_latency_seconds",
            "Time between consecutive token chunks relayed for one job.",
            INTER_TOKEN_BUCKETS,
        )
        r.register(self.inter_token)
        self.append = Histogram(
            "dacp_event_store_append_seconds",
            "Time to append one command's events to the event store (one transaction).",
            buckets=APPEND_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "dacp_queue_wait_seconds",
            "Time a job waited in the admission queue before it was placed (or timed out).",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prefix_routes = Counter(
            "dacp_prefix_routes",
            "Jobs dispatched to a server chosen by their prompt prefix, by result: hit (the "
            "server holds part of the prompt) or miss (a re-planned job counts again).",
            ["result"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "dacp_prompt_tokens",
            "Prompt tokens of completed jobs, as llama-server counted them.",
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "dacp_cached_prompt_tokens",
            "Of dacp_prompt_tokens, those llama-server took from its cache (a warm slot's "
            "matching prefix) rather than evaluated again.",
            registry=r,
        )
        self.jobs_submitted = Counter(
            "dacp_jobs_submitted", "Jobs submitted (JOB_SUBMITTED).", registry=r
        )
        self.jobs_finished = Counter(
            "dacp_jobs_finished",
            "Jobs that reached a terminal state, by state.",
            ["state"],
            registry=r,
        )
        self.jobs_failed = Counter(
            "dacp_jobs_failed", "Failed jobs by phase (setup or execution).", ["phase"], registry=r
        )
        self.tokens_generated = Counter(
            "dacp_tokens_generated",
            "Tokens generated, from recorded TOKEN_STREAM_CHUNK events.",
            registry=r,
        )
        self.events = Counter(
            "dacp_events_applied",
            "Events applied to the read model since this controller started, by catalog code.",
            ["code"],
            registry=r,
        )
        #: Requests and tokens by API key and model (bounded labels: the module says how).
        self.key_usage = KeyUsageCounters(r)
        for state in TERMINAL_CODES.values():
            self.jobs_finished.labels(state)
        for phase in ("setup", "execution"):
            self.jobs_failed.labels(phase)
        for result in ROUTE_RESULTS:
            self.prefix_routes.labels(result)
        self._since = 0
        #: Also told every time to first token (the dashboard's history: its percentiles).
        self.first_token_observers: list[Callable[[float], None]] = []

    # ------------------------------------------------ application.ports.Metrics

    def observe_time_to_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(max(0.0, seconds))
        for observer in self.first_token_observers:
            observer(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(max(0.0, seconds))

    def observe_append(self, seconds: float) -> None:
        self.append.observe(max(0.0, seconds))

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(max(0.0, seconds))

    def count_prefix_route(self, result: str) -> None:
        if result in ROUTE_RESULTS:  # bounded labels, whatever a route says
            self.prefix_routes.labels(result).inc()

    def count_prompt_tokens(self, prompt: int, cached: int) -> None:
        prompt = max(0, prompt)
        self.prompt_tokens.inc(prompt)
        self.cached_prompt_tokens.inc(min(prompt, max(0, cached)))  # the ratio stays <= 1

    # ------------------------------------------------------------ event counters

    def count_after(self, position: int) -> None:
        """Ignores events at or before ``position`` (history the follower catches up on)."""
        self._since = position

    def on_event(self, position: int, event: object) -> None:
        """The follower's listener: called from its thread once per applied event."""
        if position <= self._since:
            return
        code = code_of(event)
        self.events.labels(code).inc()
        self.key_usage.on_event(code, event)
        if code == "JOB_SUBMITTED":
            self.jobs_submitted.inc()
        elif code == "TOKEN_STREAM_CHUNK":
            self.tokens_generated.inc(max(0, int(getattr(event, "token_count", 0) or 0)))
        elif code in TERMINAL_CODES:
            self.jobs_finished.labels(TERMINAL_CODES[code]).inc()
            if code == "JOB_FAILED":
                phase = str(getattr(event, "phase", "") or "unknown")
                self.jobs_failed.labels(phase).inc()

    # ----------------------------------------------------------------- scraping

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def add_node_collector(self, collector: Collector) -> None:
        self.nodes.register(collector)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (runs the scrape-time collectors)."""
        return generate_latest(self.registry)

    def node_exposition(self) -> bytes:
        """The per-node gauges in Prometheus text format."""
        return generate_latest(self.nodes)


@dataclass
class ClusterSources:
    """Where the scrape-time gauges come from (callables, so nothing here holds a lock)."""

    nodes: Callable[[], Sequence[Mapping[str, Any]]]
    live: Callable[[], Mapping[str, LiveNode]]
    connected: Callable[[str], bool]
    active_jobs: Callable[[], int]
    store_position: Callable[[], int]
    read_model_position: Callable[[], int]
    feed_subscribers: Callable[[], int] = lambda: 0
    feed_dropped: Callable[[], int] = lambda: 0
    queue_depths: Callable[[], Mapping[str, int]] = dict
    live_local_only: Callable[[], bool] = lambda: False
    projection_failing: Callable[[], bool] = lambda: False
    projection_skipped: Callable[[], int] = lambda: 0
    agent_messages_rejected: Callable[[], Mapping[str, int]] = dict
    http_auth_failures: Callable[[], Mapping[tuple[str, int], int]] = dict
    #: Refused Enroll/Connect calls by (kind, gRPC status name).
    control_refused: Callable[[], Mapping[tuple[str, str], int]] = dict
    #: Node messages over their node's budget (counted, not acted on), by kind.
    over_budget: Callable[[], Mapping[str, int]] = dict
    #: Control streams closed because their node did not read them.
    stream_overflows: Callable[[], int] = lambda: 0


class ClusterCollector(Collector):
    """Gauges read at scrape time. A failing source leaves its metrics out and counts in
    ``dacp_scrape_errors_total`` instead of failing the whole scrape."""

    def __init__(self, sources: ClusterSources) -> None:
        self.sources = sources
        self._errors = 0
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        return []  # no duplicate-name checks at registration (and no scrape then)

    def failed(self, what: str) -> None:
        log.warning("metrics: cannot read %s", what, exc_info=True)
        with self._lock:
            self._errors += 1

    def collect(self) -> Iterable[Metric]:
        now = time.time()
        out: list[Metric] = []
        try:
            rows = list(self.sources.nodes())
        except Exception:
            self.failed("the nodes view")
            rows = None
        if rows is not None:
            out.extend(self._nodes(rows, now))
        for name, doc, fn in (
            (
                "dacp_jobs_active",
                "Jobs submitted to this controller and not yet ended.",
                self.sources.active_jobs,
            ),
            (
                "dacp_event_store_position",
                "Highest notification id in the event store.",
                self.sources.store_position,
            ),
            (
                "dacp_read_model_position",
                "Last notification id applied to the read model.",
                self.sources.read_model_position,
            ),
            (
                "dacp_event_feed_subscribers",
                "Open live event feed streams.",
                self.sources.feed_subscribers,
            ),
            (
                "dacp_read_model_lag",
                "Events stored but not yet applied to the read model.",
                lambda: max(0, self.sources.store_position() - self.sources.read_model_position()),
            ),
            (
                "dacp_projection_failing",
                "1 while the projection follower retries after an error (store unreachable).",
                lambda: int(self.sources.projection_failing()),
            ),
            (
                "dacp_live_state_local_only",
                "1 while Redis is unreachable: heartbeats are kept in this controller only.",
                lambda: int(self.sources.live_local_only()),
            ),
        ):
            try:
                out.append(_gauge(name, doc, fn))
            except Exception:
                self.failed(name)
        try:
            depth = GaugeMetricFamily(
                "dacp_queue_depth",
                "Requests waiting in the admission queue, by model.",
                labels=["model"],
            )
            for model, waiting in sorted(self.sources.queue_depths().items()):
                depth.add_metric([model], waiting)
            out.append(depth)
        except Exception:
            self.failed("the admission queue")
        try:
            out.append(
                CounterMetricFamily(
                    "dacp_projection_skipped_events",
                    "Events the read model skipped because they failed to apply "
                    "(`dacp projections rebuild` once the cause is fixed).",
                    value=self.sources.projection_skipped(),
                )
            )
        except Exception:
            self.failed("the projection follower")
        try:
            rejected = CounterMetricFamily(
                "dacp_agent_messages_rejected",
                "Agent messages the controller refused (malformed, too large, out of order, "
                "another node's job), by the refused message's kind.",
                labels=["kind"],
            )
            for kind, count in sorted(self.sources.agent_messages_rejected().items()):
                rejected.add_metric([kind], count)
            out.append(rejected)
        except Exception:
            self.failed("the rejected agent messages")
        try:
            refused = CounterMetricFamily(
                "dacp_http_auth_failures",
                "HTTP requests refused for a missing or wrong key, by API and status.",
                labels=["api", "status"],
            )
            for (api, status), count in sorted(self.sources.http_auth_failures().items()):
                refused.add_metric([api, str(status)], count)
            out.append(refused)
        except Exception:
            self.failed("the refused HTTP keys")
        try:
            control = CounterMetricFamily(
                "dacp_control_access_refused",
                "Enroll and Connect calls the control channel refused, by kind and gRPC status "
                "(recorded as ACCESS_REFUSED at most once per address every 10 s).",
                labels=["kind", "code"],
            )
            for (kind, code), count in sorted(self.sources.control_refused().items()):
                control.add_metric([kind, code], count)
            out.append(control)
            over = CounterMetricFamily(
                "dacp_node_messages_over_budget",
                "Node messages beyond their node's rate budget, counted and not acted on "
                "(refusals not answered, faults, resource reports replaced by a newer one).",
                labels=["kind"],
            )
            for kind, count in sorted(self.sources.over_budget().items()):
                over.add_metric([kind], count)
            out.append(over)
            out.append(
                CounterMetricFamily(
                    "dacp_node_streams_overflowed",
                    "Control streams closed because their node did not read what waited.",
                    value=self.sources.stream_overflows(),
                )
            )
        except Exception:
            self.failed("the control channel's counters")
        try:
            dropped = CounterMetricFamily(
                "dacp_event_feed_dropped",
                "Feed messages dropped because a subscriber fell behind (oldest first).",
                value=self.sources.feed_dropped(),
            )
            out.append(dropped)
        except Exception:
            self.failed("the event feed")
        with self._lock:
            errors = self._errors
        out.append(
            CounterMetricFamily(
                "dacp_scrape_errors",
                "Scrape-time sources that could not be read.",
                value=errors,
            )
        )
        return out

    def _nodes(self, rows: list[Mapping[str, Any]], now: float) -> list[Metric]:
        by_state = GaugeMetricFamily(
            "dacp_nodes", "Enrolled nodes by state (read model).", labels=["state"]
        )
        tally = Tally(str(r.get("state")) for r in rows)
        for state in NodeState:
            by_state.add_metric([state.value], tally.get(state.value, 0))
        connected = sum(1 for r in rows if self.sources.connected(str(r.get("node_id"))))
        return [
            by_state,
            GaugeMetricFamily(
                "dacp_nodes_connected",
                "Enrolled nodes whose control stream is open to this controller.",
                value=connected,
            ),
        ]


class NodeCollector(Collector):
    """The per-node gauges, by node id and name (``GET /metrics/nodes``, admin key only): a
    failing source leaves them out and counts in the public ``dacp_scrape_errors_total``."""

    def __init__(self, sources: ClusterSources, cluster: ClusterCollector) -> None:
        self.sources = sources
        self.cluster = cluster

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        now = time.time()
        age = GaugeMetricFamily(
            "dacp_node_heartbeat_age_seconds",
            "Seconds since the node's last heartbeat reached the controller (live state).",
            labels=["node_id", "name"],
        )
        connected = GaugeMetricFamily(
            "dacp_node_connected",
            "1 when the node's control stream is open to this controller.",
            labels=["node_id", "name"],
        )
        try:
            rows = list(self.sources.nodes())
        except Exception:
            self.cluster.failed("the nodes view")
            return []
        try:
            live = self.sources.live()
        except Exception:
            self.cluster.failed("live state")
            live = {}
        for row in rows:
            node_id = str(row.get("node_id"))
            name = str(row.get("name") or "")
            seen = live.get(node_id)
            if seen is not None:
                age.add_metric([node_id, name], round(max(0.0, now - seen.last_seen), 3))
            connected.add_metric([node_id, name], 1.0 if self.sources.connected(node_id) else 0.0)
        return [age, connected]


def _gauge(name: str, doc: str, fn: Callable[[], int]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=fn())
