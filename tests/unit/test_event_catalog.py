from __future__ import annotations

from domain.catalog import CATALOG, JOB_EVENTS, NODE_EVENTS, SEED_EVENTS, code_of
from domain.job import Job
from domain.node import Node

#: Every code the catalogue in docs/reference.md ('Event catalogue') documents. Stored events
#: carry these classes, so none may disappear; tests/unit/test_architecture_doc.py checks that
#: the document lists every code of the catalog.
DOCUMENTED_CODES = {
    "NODE_ENROLLED",
    "NODE_READY",
    "RESOURCES_REPORTED",
    "HEARTBEAT_TIMEOUT",
    "NODE_OFFLINE",
    "NODE_RECOVERED",
    "NODE_DRAIN_REQUESTED",
    "NODE_DRAINED",
    "NODE_RESUMED",
    "NODE_ERROR",
    "RPC_WORKER_STARTED",
    "RPC_WORKER_STOPPED",
    "SECURITY_VIOLATION",
    "NODE_JOB_ASSIGNED",
    "NODE_JOB_RELEASED",
    "JOB_SUBMITTED",
    "JOB_PLANNED",
    "JOB_REPLANNED",
    "JOB_DISPATCHED",
    "JOB_SETUP_VALIDATED",
    "TOKEN_STREAM_CHUNK",
    "JOB_COMPLETED",
    "JOB_FAILED",
    "JOB_CANCELLED",
    "MODEL_REGISTERED",
    "MODEL_UPDATED",
    "ENROLLMENT_TOKEN_REDEEMED",
}


def test_catalog_holds_every_documented_event() -> None:
    assert DOCUMENTED_CODES <= set(CATALOG)
    assert set(SEED_EVENTS) <= set(CATALOG)


def test_codes_are_unique_and_on_their_aggregate() -> None:
    codes = [cls.code for cls in (*NODE_EVENTS, *JOB_EVENTS)]
    assert len(codes) == len(set(codes))
    assert all(c.__qualname__.startswith("Node.") for c in NODE_EVENTS)
    assert all(c.__qualname__.startswith("Job.") for c in JOB_EVENTS)
    assert Node.Enrolled.code == "NODE_ENROLLED"
    assert Job.TokenStreamChunk.code == "TOKEN_STREAM_CHUNK"


def test_code_of_instances() -> None:
    from tests.unit.domain_builders import new_node

    node = new_node()
    assert code_of(node.collect_events()[0]) == "NODE_ENROLLED"
