"""Everything the HTTP and gRPC interfaces need, wired once by the composition root."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from application.context_guard import ContextGuard
from application.controller import Controller
from application.enrollment import EnrollmentService
from application.ports import LiveState
from infrastructure.projection_follower import ProjectionFollower
from infrastructure.read_model_store import ReadModelStore
from infrastructure.settings import Settings
from infrastructure.tls import ServerTls
from interfaces.grpc_server import AgentConnections


@dataclass
class Services:
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
    extras: dict[str, Any] = field(default_factory=dict)
