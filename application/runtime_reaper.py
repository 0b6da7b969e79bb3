"""Stops the RPC workers and llama-servers no job needs any more.

A runtime (a primary's llama-server, over RPC workers for a split) stays warm after its last
job, so the next job of the model starts at once. Once a node has held no job for its grace,
the reaper records ``NODE_RUNTIME_RETIRED`` on it (the node no longer serves the runtime, so
the scheduler no longer counts the server as warm) and tells its agent to stop its process:

* an RPC worker after ``RPC_WORKER_IDLE_GRACE`` (``StopRpcWorker``, which also closes its port);
* a primary's llama-server after ``SERVER_IDLE_GRACE`` (``StopServer``): its memory (the
  weights and the KV cache on its GPUs) is free for other plans again. The primary of a split
  goes after ``RPC_WORKER_IDLE_GRACE``, as its workers do, since its server cannot serve
  without them.

The decision is a pure function of the node's read-model row (its runtime, its jobs, and
``idle_since``, the time of the event that released its last job) and the clock, so several
controllers agree; each stops only the processes of agents connected to it. The aggregate's
guard refuses the retirement when a job was assigned to the node meanwhile, and then nothing
is stopped. A retired server's cache is forgotten by the prefix router (``forget``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from application.controller import Controller
from application.errors import NotFound
from application.ports import AgentGateway, ReadModel
from domain.errors import DomainError
from domain.runtimes import runtime_key, server_name

log = logging.getLogger(__name__)

#: How long an idle RPC worker is kept for warm reuse (``RPC_WORKER_IDLE_GRACE``).
DEFAULT_RPC_WORKER_IDLE_GRACE = 300.0
#: How long an idle one-node llama-server is kept for warm reuse (``SERVER_IDLE_GRACE``).
DEFAULT_SERVER_IDLE_GRACE = 900.0


@dataclass(frozen=True, slots=True)
class IdleRuntime:
    """A node whose runtime no job has used for its grace: ``worker`` for an RPC worker, else
    the primary's llama-server."""

    idle_seconds: float
    worker: bool


def idle_runtime(
    row: Mapping[str, Any], now: float, worker_grace: float, server_grace: float
) -> IdleRuntime | None:
    """The node's idle runtime once its grace has passed (``worker_grace`` for an RPC worker
    and a split's primary, ``server_grace`` for a one-node server); None while it is needed."""
    runtime = row.get("runtime")
    since = row.get("idle_since")
    if not runtime or row["current_jobs"] or not since:
        return None
    plan = runtime["plan"]
    workers = plan.get("workers") or []
    worker = any(w.get("node_id") == row["node_id"] for w in workers)
    if not worker and (plan.get("primary") or {}).get("node_id") != row["node_id"]:
        return None
    grace = worker_grace if worker or workers else server_grace
    idle = now - dt.datetime.fromisoformat(str(since)).timestamp()
    return IdleRuntime(idle, worker) if idle >= grace else None


def idle_worker(row: Mapping[str, Any], now: float, grace: float) -> float | None:
    """Seconds the node's RPC worker has been idle, once that is at least ``grace``; None
    when it is needed (or the node is no runtime's worker)."""
    idle = idle_runtime(row, now, grace, grace)
    return idle.idle_seconds if idle is not None and idle.worker else None


class RuntimeReaper:
    def __init__(
        self,
        app: Controller,
        nodes: ReadModel,
        gateway: AgentGateway,
        grace: float,
        server_grace: float = DEFAULT_SERVER_IDLE_GRACE,
        forget: Callable[[str], None] = lambda _server: None,
    ) -> None:
        if grace <= 0:
            raise ValueError("RPC_WORKER_IDLE_GRACE must be positive")
        if server_grace <= 0:
            raise ValueError("SERVER_IDLE_GRACE must be positive")
        self.app = app
        self.nodes = nodes
        self.gateway = gateway
        self.grace = grace
        self.server_grace = server_grace
        #: Forgets what a stopped server's cache held (``PrefixRouter.forget``).
        self.forget = forget

    async def sweep(self, now: float) -> list[str]:
        """Retires idle runtimes on connected nodes and stops their processes; returns the
        nodes whose RPC worker or llama-server was stopped."""
        stopped = []
        for row in self.nodes.list_nodes():
            node_id = row["node_id"]
            idle = idle_runtime(row, now, self.grace, self.server_grace)
            if idle is None or not self.gateway.is_connected(node_id):
                continue
            key = runtime_key(row["runtime"])
            try:
                await asyncio.to_thread(
                    self.app.retire_runtime, node_id, key, round(idle.idle_seconds, 1)
                )
            except (DomainError, NotFound) as e:
                log.debug("not retiring runtime %s on %s: %s", key, node_id, e)
                continue
            if idle.worker:
                setting = f"RPC_WORKER_IDLE_GRACE={self.grace:g}"
                reason = f"idle for {idle.idle_seconds:.0f} s ({setting})"
                sent = self.gateway.stop_rpc_worker(node_id, reason)
            else:
                split = bool(row["runtime"]["plan"].get("workers"))
                setting = (
                    f"RPC_WORKER_IDLE_GRACE={self.grace:g}, its workers' grace"
                    if split
                    else f"SERVER_IDLE_GRACE={self.server_grace:g}"
                )
                reason = f"idle for {idle.idle_seconds:.0f} s ({setting})"
                self.forget(server_name(node_id, key))
                sent = self.gateway.stop_server(node_id, reason)
            if sent:
                stopped.append(node_id)
        return stopped
