"""The job traffic of :class:`agent.control.control_client.AgentSession` (:class:`JobTraffic`):
controller messages handed to the :class:`ControlHandler` (each in a task of its own), job
messages sent up (journalled first, see :mod:`agent.control.job_journal`), and the jobs resumed
after a reconnect.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc.aio

from agent.control.control_handler import (
    ControlHandler,
    RpcPeerHandler,
    ServerHandler,
    job_failure,
    role_name,
    setup_failure,
    worker_status,
)
from agent.control.job_journal import JobJournal
from agent.models.model_proof import prove
from agent.models.model_transfers import ModelTransfers
from agent.runtime.job_messages import AGENT_STOPPING, JOB_LOST
from wire import control_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Connection:
    """One open ``Connect`` stream and the messages waiting to go out on it."""

    call: grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControllerMessage]
    queue: asyncio.Queue[pb.AgentMessage] = field(default_factory=asyncio.Queue)


class JobTraffic:
    """Job messages both ways between the controller's stream and ``handler`` (model
    transfers go to ``transfers``). ``draining`` says whether the agent drains: new work is
    refused meanwhile, running jobs go on."""

    def __init__(
        self,
        handler: ControlHandler,
        transfers: ModelTransfers,
        draining: Callable[[], bool],
    ) -> None:
        self.handler = handler
        self.transfers = transfers
        self._draining = draining
        self.journal = JobJournal()
        #: The stream job messages go out on (None while disconnected).
        self.conn: Connection | None = None
        #: The handler calls running now (cancelled when the session stops).
        self.tasks: set[asyncio.Task[None]] = set()

    async def cancel(self) -> None:
        """Cancels the handler calls still running, and waits for them to end."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def resume_jobs(self, conn: Connection, welcome: pb.Welcome) -> None:
        """Re-sends what the controller lacks of the jobs it still waits for; cancels the
        jobs this node leads that it no longer waits for; reports the ones this node has
        never heard of (the agent restarted meanwhile)."""
        named = {job.job_id: job.next_seq for job in welcome.resumed_jobs}
        self.journal.keep_only(named)
        try:
            active = set(self.handler.active_job_ids())
        except Exception:
            log.exception("handler.active_job_ids() failed")
            active = set()
        for job_id, next_seq in named.items():
            replay = self.journal.replay(job_id, next_seq)
            for message in replay:
                conn.queue.put_nowait(message)
            if replay:
                log.info(
                    "job %s: re-sent %d message(s) from token %d", job_id, len(replay), next_seq
                )
            elif job_id not in active and job_id not in self.journal:
                log.warning("job %s: the controller waits for it, but it does not run here", job_id)
                conn.queue.put_nowait(
                    job_failure(job_id, "execution", JOB_LOST, "its node's agent restarted")
                )
        for job_id in active - named.keys():
            log.warning("job %s: the controller no longer waits for it; cancelling it", job_id)
            cancel = pb.ControllerMessage(
                cancel_job=pb.CancelJob(job_id=job_id, reason="the controller gave it up")
            )
            self.dispatch(cancel)

    async def send(self, message: pb.AgentMessage) -> None:
        """The ``send`` given to the handler: queue ``message`` on the current stream. Never
        blocks or raises; the write loop sends the queue in order (see
        :func:`merge_token_chunks`). Token chunks and results are journalled first, so a
        reconnect can re-send them (see :meth:`resume_jobs`)."""
        kind = message.WhichOneof("payload")
        if kind == "token_chunk":
            self.journal.record_chunk(message.token_chunk)
        elif kind == "job_result":
            self.journal.record_result(message.job_result)
        conn = self.conn
        if conn is None:
            if kind not in ("token_chunk", "job_result"):
                log.warning("not connected to the controller; dropping %s", kind)
            return
        conn.queue.put_nowait(message)

    def dispatch(self, message: pb.ControllerMessage) -> None:
        kind = message.WhichOneof("payload")
        handler = self.handler
        send = self.send
        coro: Coroutine[Any, Any, None]
        if self._draining() and kind in ("execution_plan", "start_rpc_worker"):
            coro = self._refuse_while_draining(message)
        elif kind == "execution_plan":
            coro = handler.on_plan(message.execution_plan, send)
        elif kind == "start_rpc_worker":
            coro = handler.on_start_rpc_worker(message.start_rpc_worker, send)
        elif kind == "stop_rpc_worker":
            coro = handler.on_stop_rpc_worker(message.stop_rpc_worker, send)
        elif kind == "fetch_model":
            coro = self.transfers.on_fetch(message.fetch_model, send)
        elif kind == "evict_model":
            coro = self.transfers.on_evict(message.evict_model, send)
        elif kind == "probe_links":
            coro = self.transfers.on_probe_links(message.probe_links, send)
        elif kind == "prove_model":
            coro = prove(self.transfers.store, message.prove_model, send)
        elif kind == "nodes_revoked":
            self.nodes_revoked(message.nodes_revoked.node_ids)
            return
        elif kind == "stop_server":
            if not isinstance(handler, ServerHandler):
                return
            coro = handler.on_stop_server(message.stop_server)
        elif kind == "rpc_worker_peers":
            if not isinstance(handler, RpcPeerHandler):
                return
            coro = handler.on_rpc_worker_peers(message.rpc_worker_peers, send)
        elif kind == "cancel_job":
            coro = handler.on_cancel(message.cancel_job, send)
        elif kind == "drain":
            log.info("controller requested drain")
            coro = handler.on_drain(send)
        elif kind == "resume":
            log.info("controller requested resume")
            coro = handler.on_resume(send)
        elif kind == "message_rejected":
            refused = message.message_rejected
            log.warning(
                "the controller refused our %s (job %s): %s",
                refused.kind or "message",
                refused.job_id or "-",
                refused.reason,
            )
            return
        elif kind == "welcome":
            log.debug("ignoring a repeated Welcome")
            return
        else:
            log.warning("ignoring an unknown controller message (newer controller?)")
            return
        task = asyncio.create_task(self._run_handler(kind, message, coro))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _refuse_while_draining(self, message: pb.ControllerMessage) -> None:
        """New work that was on its way when the agent began to drain: the controller plans
        it elsewhere."""
        error = "the node is stopping (its agent drains)"
        if message.WhichOneof("payload") == "execution_plan":
            plan = message.execution_plan
            log.info("refusing job %s: %s", plan.job_id, error)
            await self.send(setup_failure(plan.job_id, role_name(plan.role), error, AGENT_STOPPING))
        else:
            start = message.start_rpc_worker
            log.info("refusing the RPC worker of job %s: %s", start.job_id, error)
            failed = pb.RpcWorkerStatus.FAILED
            await self.send(worker_status(start.job_id, failed, start.host, start.port, error))

    def nodes_revoked(self, node_ids: Sequence[str]) -> None:
        """Revoked nodes: refused by the model file server and the RPC worker at once."""
        if not node_ids:
            return
        self.transfers.revoke(node_ids)
        handler = self.handler
        if isinstance(handler, RpcPeerHandler):
            task = asyncio.create_task(self._revoke_rpc_peers(handler, list(node_ids)))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _revoke_rpc_peers(self, handler: RpcPeerHandler, node_ids: list[str]) -> None:
        try:
            await handler.on_nodes_revoked(node_ids)
        except Exception:
            log.exception("handler failed on revoked nodes %s", node_ids)

    async def _run_handler(
        self, kind: str, message: pb.ControllerMessage, coro: Coroutine[Any, Any, None]
    ) -> None:
        try:
            await coro
        except Exception as exc:
            log.exception("handler failed on %s", kind)
            await self._report_handler_failure(kind, message, exc)

    async def _report_handler_failure(
        self, kind: str, message: pb.ControllerMessage, exc: Exception
    ) -> None:
        error = f"agent handler failed: {exc}"
        if kind == "execution_plan":
            plan = message.execution_plan
            await self.send(setup_failure(plan.job_id, role_name(plan.role), error, "AGENT_ERROR"))
        elif kind == "start_rpc_worker":
            start = message.start_rpc_worker
            await self.send(
                worker_status(
                    start.job_id, pb.RpcWorkerStatus.FAILED, start.host, start.port, error
                )
            )
