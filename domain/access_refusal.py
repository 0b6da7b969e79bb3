"""A refused attempt to join or reach the cluster: an enrollment the controller turned down, or
a control stream it would not open. Each refusal is an aggregate of its own (one event, so
refusals never contend with each other or with the nodes they name); the controller records
at most one per source address every few seconds (``application/rejections.py``), counting
the rest as ``suppressed``."""

from __future__ import annotations

from typing import ClassVar, NotRequired, TypedDict
from uuid import UUID, uuid4

from eventsourcing.domain import Aggregate

#: What was refused.
ENROLL, CONNECT = "enroll", "connect"


class RefusalTerms(TypedDict):
    """What a refusal is recorded with (:meth:`AccessRefusal.record`'s terms but its id), for
    a caller that passes them on: what was refused, from where and why, always; the rest as
    ``record`` defaults them."""

    kind: str
    source: str
    reason: str
    node_name: NotRequired[str]
    node_id: NotRequired[str]
    security_violation: NotRequired[bool]
    suppressed: NotRequired[int]


class AccessRefusal(Aggregate):
    class Refused(Aggregate.Created):
        code: ClassVar[str] = "ACCESS_REFUSED"
        kind: str  # ENROLL or CONNECT
        source: str  # the address the attempt came from
        node_name: str  # the name an enrollment asked for ("" for a stream)
        node_id: str  # the node a stream claimed to be ("" for an enrollment)
        reason: str
        #: The attempt broke the address rules (outside ALLOWED_PEER_CIDRS, or another
        #: address than it came from): the enrollment-time SECURITY_VIOLATION.
        security_violation: bool
        suppressed: int

    def __init__(
        self,
        kind: str,
        source: str,
        node_name: str,
        node_id: str,
        reason: str,
        security_violation: bool,
        suppressed: int,
    ) -> None:
        self.kind = kind
        self.source = source
        self.node_name = node_name
        self.node_id = node_id
        self.reason = reason
        self.security_violation = security_violation
        self.suppressed = suppressed

    @classmethod
    def record(
        cls,
        *,
        kind: str,
        source: str,
        reason: str,
        node_name: str = "",
        node_id: str = "",
        security_violation: bool = False,
        suppressed: int = 0,
        refusal_id: UUID | None = None,
    ) -> AccessRefusal:
        if kind not in (ENROLL, CONNECT):
            raise ValueError(f"unknown kind of access {kind!r}")
        return cls._create(
            cls.Refused,
            id=refusal_id or uuid4(),
            kind=kind,
            source=source,
            node_name=node_name,
            node_id=node_id,
            reason=reason,
            security_violation=security_violation,
            suppressed=suppressed,
        )
