"""Stops RPC workers no runtime needs any more.

A split runtime (a primary's llama-server over RPC workers) stays warm after its last job, so
the next job of the model starts at once. Its workers stay open to the primary meanwhile. Once
a worker node has held no job for ``RPC_WORKER_IDLE_GRACE``, the reaper records
``NODE_RUNTIME_RETIRED`` on it (the node no longer serves the runtime, so the scheduler no
longer counts the server as warm) and sends its agent ``StopRpcWorker``, which stops the
worker and closes its port.

The decision is a pure function of the node's read-model row (its runtime, its jobs, and
``idle_since``, the time of the event that released its last job) and the clock, so several
controllers agree; each stops only the workers whose agents are connected to it. The
aggregate's guard refuses the retirement when a job was assigned to the node meanwhile, and
then nothing is stopped.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

from application.controller import Controller
from application.errors import NotFound
from application.ports import AgentGateway, ReadModel
from domain.errors import DomainError
from domain.runtimes import runtime_key

log = logging.getLogger(__name__)

#: How long an idle RPC worker is kept for warm reuse (``RPC_WORKER_IDLE_GRACE``).
DEFAULT_RPC_WORKER_IDLE_GRACE = 300.0


def idle_worker(row: Mapping[str, Any], now: float, grace: float) -> float | None:
    """Seconds the node's RPC worker has been idle, once that is at least ``grace``; None
    when it is needed (or the node is no runtime's worker)."""
    runtime = row.get("runtime")
    since = row.get("idle_since")
    if not runtime or row["current_jobs"] or not since:
        return None
    workers = runtime["plan"].get("workers") or []
    if not any(worker.get("node_id") == row["node_id"] for worker in workers):
        return None  # a primary: its llama-server is stopped by its agent, not here
    idle = now - dt.datetime.fromisoformat(str(since)).timestamp()
    return idle if idle >= grace else None


class WorkerReaper:
    def __init__(
        self, app: Controller, nodes: ReadModel, gateway: AgentGateway, grace: float
    ) -> None:
        if grace <= 0:
            raise ValueError("RPC_WORKER_IDLE_GRACE must be positive")
        self.app = app
        self.nodes = nodes
        self.gateway = gateway
        self.grace = grace

    async def sweep(self, now: float) -> list[str]:
        """Retires idle runtimes on connected worker nodes and stops their workers; returns
        the nodes whose worker was stopped."""
        stopped = []
        for row in self.nodes.list_nodes():
            node_id = row["node_id"]
            idle = idle_worker(row, now, self.grace)
            if idle is None or not self.gateway.is_connected(node_id):
                continue
            key = runtime_key(row["runtime"])
            try:
                await asyncio.to_thread(self.app.retire_runtime, node_id, key, round(idle, 1))
            except (DomainError, NotFound) as e:
                log.debug("not retiring runtime %s on %s: %s", key, node_id, e)
                continue
            reason = f"idle for {idle:.0f} s (RPC_WORKER_IDLE_GRACE={self.grace:g})"
            if self.gateway.stop_rpc_worker(node_id, reason):
                stopped.append(node_id)
        return stopped
