"""The port between the agent's control session and what it runs: :class:`ControlHandler` receives
every downlink message; :class:`NullHandler` (no runtime) refuses every plan; helpers build the
common replies."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

from wire import control_pb2 as pb

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)


Send = Callable[[pb.AgentMessage], Awaitable[None]]
"""Queues one AgentMessage for the controller (dropped, with a log line, while disconnected)."""


# ---------------------------------------------------------------------------
# Handler protocol
# ---------------------------------------------------------------------------


@runtime_checkable
class ControlHandler(Protocol):
    """Receives every ControllerMessage except Welcome. Each call runs in its own task, so a
    long ``on_plan`` does not block a later ``on_cancel``. ``send`` queues an AgentMessage
    upstream (SetupResult, RpcWorkerStatus, TokenChunk, JobResult, RuntimeFault)."""

    async def on_plan(self, plan: pb.ExecutionPlan, send: Send) -> None: ...

    async def on_start_rpc_worker(self, msg: pb.StartRpcWorker, send: Send) -> None: ...

    async def on_stop_rpc_worker(self, msg: pb.StopRpcWorker, send: Send) -> None: ...

    async def on_cancel(self, msg: pb.CancelJob, send: Send) -> None: ...

    async def on_drain(self, send: Send) -> None: ...

    async def on_resume(self, send: Send) -> None: ...

    def active_job_ids(self) -> list[str]: ...

    async def close(self) -> None: ...


@runtime_checkable
class RpcPeerHandler(Protocol):
    """What a handler that runs an RPC worker also hears: who may reach the worker now that a
    job using it ended (``RpcWorkerPeers``), and which nodes were revoked (``NodesRevoked`` and
    ``Welcome.revoked_node_ids``: their addresses are refused at once)."""

    async def on_rpc_worker_peers(self, msg: pb.RpcWorkerPeers, send: Send) -> None: ...

    async def on_nodes_revoked(self, node_ids: Sequence[str]) -> None: ...


@runtime_checkable
class ServerHandler(Protocol):
    """What a handler that runs a llama-server also hears: stop it, the controller retired its
    idle runtime (``StopServer``). A server a job uses is kept."""

    async def on_stop_server(self, msg: pb.StopServer) -> None: ...


NO_RUNTIME = "no runtime configured"


def role_name(role: int) -> str:
    return "worker" if role == pb.ExecutionPlan.WORKER else "primary"


def setup_failure(
    job_id: str,
    role: str,
    error: str,
    error_code: str,
    failed_node_id: str = "",
    *,
    failed_device: str = "",
    failed_bytes: int = 0,
) -> pb.AgentMessage:
    """``SetupResult{ok=false}`` for a plan this node cannot run (an out-of-memory names the
    device and the bytes it asked for)."""
    return pb.AgentMessage(
        setup_result=pb.SetupResult(
            job_id=job_id,
            ok=False,
            error=error,
            error_code=error_code,
            role=role,
            failed_node_id=failed_node_id,
            failed_device=failed_device,
            failed_bytes=max(0, failed_bytes),
        )
    )


def worker_status(
    job_id: str,
    state: pb.RpcWorkerStatus.State,
    host: str,
    port: int,
    error: str = "",
    *,
    error_code: str = "",
    failed_device: str = "",
    failed_bytes: int = 0,
) -> pb.AgentMessage:
    """``RpcWorkerStatus`` of this node's RPC worker."""
    return pb.AgentMessage(
        rpc_worker_status=pb.RpcWorkerStatus(
            job_id=job_id,
            state=state,
            host=host,
            port=port,
            error=error,
            error_code=error_code,
            failed_device=failed_device,
            failed_bytes=max(0, failed_bytes),
        )
    )


class NullHandler:
    """A handler without a runtime: refuses every plan and RPC worker."""

    async def on_plan(self, plan: pb.ExecutionPlan, send: Send) -> None:
        log.warning("refusing plan for job %s: %s", plan.job_id, NO_RUNTIME)
        await send(setup_failure(plan.job_id, role_name(plan.role), NO_RUNTIME, "NO_RUNTIME"))

    async def on_start_rpc_worker(self, msg: pb.StartRpcWorker, send: Send) -> None:
        log.warning("refusing RPC worker for job %s: %s", msg.job_id, NO_RUNTIME)
        await send(
            worker_status(msg.job_id, pb.RpcWorkerStatus.FAILED, msg.host, msg.port, NO_RUNTIME)
        )

    async def on_stop_rpc_worker(self, msg: pb.StopRpcWorker, send: Send) -> None:
        await send(worker_status(msg.job_id, pb.RpcWorkerStatus.STOPPED, "", 0))

    async def on_cancel(self, msg: pb.CancelJob, send: Send) -> None:
        log.info("cancel for job %s: nothing is running", msg.job_id)

    async def on_drain(self, send: Send) -> None:
        log.info("drain requested: no jobs are running")

    async def on_resume(self, send: Send) -> None:
        log.info("resume requested")

    def active_job_ids(self) -> list[str]:
        return []

    async def close(self) -> None:
        return None


def job_failure(
    job_id: str,
    phase: str,
    error_code: str,
    error: str,
    *,
    finish_reason: str = "",
    failed_node_id: str = "",
    failed_device: str = "",
    failed_bytes: int = 0,
) -> pb.AgentMessage:
    """``JobResult{ok=false}`` for a job that failed in ``phase``."""
    return pb.AgentMessage(
        job_result=pb.JobResult(
            job_id=job_id,
            ok=False,
            finish_reason=finish_reason,
            error=error,
            error_code=error_code,
            phase=phase,
            failed_node_id=failed_node_id,
            failed_device=failed_device,
            failed_bytes=max(0, failed_bytes),
        )
    )
