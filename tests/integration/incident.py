"""A scripted incident for the operations tools (events, replay, diagnose, admin jobs API).

Node A misses heartbeats (HEARTBEAT_TIMEOUT, then NODE_OFFLINE) while its job is still in
setup, so the job fails before execution. Node B first completes a job, reports a public
RPC peer (SECURITY_VIOLATION), then its control stream closes while a job is streaming
tokens, so that job fails during execution.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from application.commands import Delta
from infrastructure.storage import Storage
from tests.conftest import TEST_DATABASE_URL
from tests.integration.store_builders import enroll_ready, run_job, submit_job
from tests.plans import one_node_plan

SETUP_REASON_TEMPLATE = "setup failed after 1 plans: NODE_LOST: node {node} disconnected"


@dataclass(frozen=True)
class Incident:
    node_a: UUID
    node_b: UUID
    setup_failed_job: UUID
    execution_failed_job: UUID
    completed_job: UUID


def script_incident(storage: Storage) -> Incident:
    app = storage.app
    node_a = enroll_ready(app, "node-a")
    node_b = enroll_ready(app, "node-b")
    completed = run_job(app, node_b, "all went well")

    # Node A: dispatched, then its heartbeats stop before setup is validated.
    setup_job = submit_job(app)
    app.plan_and_dispatch(
        setup_job, one_node_plan(node_a, model="smollm2"), {str(node_a): "primary"}
    )
    app.heartbeat_timeout(node_a, 7.0)
    app.mark_offline(node_a, "no heartbeat for 16.0 s")
    app.fail(setup_job, SETUP_REASON_TEMPLATE.format(node=node_a), "setup_failed")

    # Node B: a public peer is refused, then the node is lost mid-stream.
    app.security_violation(node_b, "203.0.113.7", "RPC peer address is not private", "")
    exec_job = submit_job(app)
    app.plan_and_dispatch(
        exec_job, one_node_plan(node_b, model="smollm2"), {str(node_b): "primary"}
    )
    app.validate_setup(exec_job)
    app.record_token_chunks({exec_job: [Delta(0, "Hel"), Delta(1, "lo", 2)]})
    position = app.mark_offline(node_b, "control stream closed")
    storage.follower.wait(position, timeout=10)
    return Incident(node_a, node_b, setup_job, exec_job, completed)


def database_url(env: dict[str, str]) -> str:
    """The ``DATABASE_URL`` of a test store environment (Postgres schema or SQLite file)."""
    if env["PERSISTENCE_MODULE"] == "eventsourcing.sqlite":
        return f"sqlite:///{env['SQLITE_DBNAME']}"
    return f"{TEST_DATABASE_URL}?schema={env['POSTGRES_SCHEMA']}"
