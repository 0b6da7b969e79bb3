"""Everything the HTTP and gRPC interfaces need, wired once by the composition root.

:class:`CoreServices` is what exists before anything runs (the store, live state, settings);
:class:`Services` adds the running parts, each built once by ``start_controller`` and passed
in at construction. The HTTP app provides each field to the handlers that declare it
(``jobs: Provided[JobManager | None]``, ``svc: Provided[Services]``:
:func:`interfaces.http.http_app.dependencies`).
A part is None only in an app built without it (tests, the schema): the routes that need
it answer 503 "not running"."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeAlias, TypeVar

from litestar.di import NamedDependency
from litestar.params import SkipValidation

from application.api_keys import KeyBook
from application.context_guard import ContextGuard
from application.controller import Controller
from application.enrollment import EnrollmentService
from application.job_manager import JobManager
from application.metrics_history import MetricsHistory
from application.model_claims import ModelClaims
from application.model_transfers import TransferCoordinator
from application.node_steering import NodeSteering
from application.ports import LiveState, ModelRows
from infrastructure.metrics import PrometheusMetrics
from infrastructure.projection_follower import ProjectionFollower
from infrastructure.read_model_store import ReadModelStore
from infrastructure.redis_rate_limiter import KeyLimiter
from infrastructure.settings import Settings
from infrastructure.tls import ServerTls
from interfaces.grpc.grpc_server import AgentConnections
from interfaces.http.admin.event_feed import EventFeed

T = TypeVar("T")

#: A handler parameter the HTTP app provides by its name (:func:`interfaces.http.http_app.
#: dependencies`), passed as it is: the type is for mypy, never validated or converted.
Provided: TypeAlias = NamedDependency[SkipValidation[T]]


@dataclass
class CoreServices:
    settings: Settings
    app: Controller
    read_model: ReadModelStore
    follower: ProjectionFollower
    live: LiveState
    connections: AgentConnections
    enrollment: EnrollmentService
    #: Refuses a prompt longer than the context before any node sees it.
    context_guard: ContextGuard
    #: The controller's TLS material; None with GRPC_INSECURE=true.
    tls: ServerTls | None = None
    #: Refused HTTP keys by (api, status): counted for /metrics, not recorded as events.
    auth_failures: Counter[tuple[str, int]] = field(default_factory=Counter)
    #: Counts managed keys' limits (Redis when configured); None: no key is limited.
    limiter: KeyLimiter | None = None

    @cached_property
    def keys(self) -> KeyBook:
        """The managed inference keys (checked by ``inference_guard``, kept by the admin API)."""
        return KeyBook(self.app, self.read_model)


@dataclass
class Services(CoreServices):
    """The core and the running parts (None: not running in this app)."""

    jobs: JobManager | None = None
    transfers: TransferCoordinator | None = None
    claims: ModelClaims | None = None
    metrics: PrometheusMetrics | None = None
    feed: EventFeed | None = None
    history: MetricsHistory | None = None
    #: Drains, resumes and revokes nodes (records, then tells them).
    steering: NodeSteering | None = None
    #: The gRPC port bound (GRPC_PORT=0: a free one); None: GRPC_PORT as configured.
    grpc_port: int | None = None
    #: The models' rows in memory, read on the event loop by every inference request (None:
    #: read from the views in a thread).
    model_rows: ModelRows | None = None

    @classmethod
    def running(
        cls,
        core: CoreServices,
        *,
        jobs: JobManager,
        transfers: TransferCoordinator,
        claims: ModelClaims,
        metrics: PrometheusMetrics,
        feed: EventFeed,
        history: MetricsHistory,
        steering: NodeSteering,
        grpc_port: int,
        model_rows: ModelRows,
    ) -> Services:
        """The running controller's services: ``core`` with every part."""
        return cls(
            settings=core.settings,
            app=core.app,
            read_model=core.read_model,
            follower=core.follower,
            live=core.live,
            connections=core.connections,
            enrollment=core.enrollment,
            context_guard=core.context_guard,
            tls=core.tls,
            auth_failures=core.auth_failures,
            limiter=core.limiter,
            jobs=jobs,
            transfers=transfers,
            claims=claims,
            metrics=metrics,
            feed=feed,
            history=history,
            steering=steering,
            grpc_port=grpc_port,
            model_rows=model_rows,
        )
