"""A fake controller for agent tests: :class:`FakeControlPlane` serves the real gRPC protocol
on 127.0.0.1 (the product's servicer lives in ``interfaces/``). It records every request,
checks the stream metadata, can refuse tokens or identities, push downlink messages, break
streams, and name the jobs it still waits for in its Welcome. Also the agent-side helpers
the agent tests share (a recording handler, a config, a running session)."""

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from agent.agent_config import (
    AgentConfig,
)
from agent.control.control_client import AgentSession
from agent.control.control_handler import Send
from domain.enrollment_token import mint_token
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

#: Well-formed tokens (the agent checks a token's form before it sends it anywhere), signed
#: with a secret of the fake's own; it takes the first and refuses the second.
GOOD_TOKEN = mint_token(b"fake-controller-secret", "good", 4e9, False, None)
REFUSED_TOKEN = mint_token(b"fake-controller-secret", "refused", 4e9, False, None)
REFUSED_MESSAGE = "enrollment token is invalid or expired"
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]

# A ControllerMessage to push, a status to abort with, or CLOSE to end the stream with OK.
CLOSE = "close"
Outbound = pb.ControllerMessage | grpc.StatusCode | str


# ---------------------------------------------------------------------------
# The fake controller
# ---------------------------------------------------------------------------


@dataclass(eq=False)
class FakeStream:
    node_id: str
    metadata: dict[str, str]
    received: list[tuple[float, pb.AgentMessage]] = field(default_factory=list)
    outbound: asyncio.Queue[Outbound] = field(default_factory=asyncio.Queue)
    #: The agent said Goodbye (it stops).
    said_goodbye: bool = False

    def kinds(self) -> list[str]:
        return [str(msg.WhichOneof("payload")) for _, msg in self.received]

    def of_kind(self, kind: str) -> list[tuple[float, pb.AgentMessage]]:
        return [(t, m) for t, m in self.received if m.WhichOneof("payload") == kind]


class FakeControlPlane(pb_grpc.ControlPlaneServicer):
    """Fake controller servicer for agent tests (not the product's servicer)."""

    def __init__(self, *, heartbeat_interval: float = 1.0) -> None:
        self.tokens = {GOOD_TOKEN}
        self.heartbeat_interval = heartbeat_interval
        self.enroll_requests: list[pb.EnrollRequest] = []
        self.credentials: dict[str, str] = {}
        self.streams: list[FakeStream] = []
        self.connect_attempts = 0
        self.rejected_connects = 0
        #: The jobs the Welcome names (job id: the first token sequence number it lacks).
        self.resumed: dict[str, int] = {}

    async def Enroll(
        self, request: pb.EnrollRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EnrollResponse:
        self.enroll_requests.append(request)
        if request.enrollment_token not in self.tokens:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED_MESSAGE)
        node_id = f"node-{len(self.credentials) + 1}"
        credential = secrets.token_urlsafe(16)
        self.credentials[node_id] = credential
        return pb.EnrollResponse(
            node_id=node_id,
            node_credential=credential,
            controller_version="fake-1",
            heartbeat_interval_seconds=self.heartbeat_interval,
        )

    async def Connect(
        self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        self.connect_attempts += 1
        metadata = {str(k): str(v) for k, v in (context.invocation_metadata() or ())}
        node_id = metadata.get("x-node-id", "")
        credential = metadata.get("x-node-credential", "")
        if not credential or self.credentials.get(node_id) != credential:
            self.rejected_connects += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown node or bad credential")
        stream = FakeStream(node_id, metadata)
        self.streams.append(stream)
        first = await context.read()
        if first is EOF or first.WhichOneof("payload") != "hello" or first.hello.node_id != node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be Hello")
        stream.received.append((time.monotonic(), first))
        welcome = pb.Welcome(
            controller_version="fake-1",
            node_id=node_id,
            heartbeat_interval_seconds=self.heartbeat_interval,
            resumed_jobs=[pb.ResumedJob(job_id=j, next_seq=n) for j, n in self.resumed.items()],
        )
        await context.write(pb.ControllerMessage(welcome=welcome))
        reader = asyncio.create_task(self._read(context, stream))
        try:
            while True:
                item = await stream.outbound.get()
                if item == CLOSE:
                    return
                if isinstance(item, grpc.StatusCode):
                    await context.abort(item, "fake controller broke the stream")
                assert isinstance(item, pb.ControllerMessage)
                await context.write(item)
        finally:
            reader.cancel()

    @staticmethod
    async def _read(context: grpc.aio.ServicerContext[Any, Any], stream: FakeStream) -> None:
        while True:
            message = await context.read()
            if message is EOF:
                return
            if message.WhichOneof("payload") == "goodbye":  # the controller ends the stream
                stream.said_goodbye = True
                stream.outbound.put_nowait(CLOSE)
            stream.received.append((time.monotonic(), message))


async def start_server(fake: FakeControlPlane, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_ControlPlaneServicer_to_server(fake, server)  # type: ignore[no-untyped-call]
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------
# Agent side helpers
# ---------------------------------------------------------------------------


class RecordingHandler:
    """A ControlHandler that records what reaches it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.drained = asyncio.Event()
        self.jobs = ["job-a", "job-b"]
        self.closed = False

    async def on_plan(self, plan: pb.ExecutionPlan, send: Send) -> None:
        self.calls.append(f"plan:{plan.job_id}")

    async def on_start_rpc_worker(self, msg: pb.StartRpcWorker, send: Send) -> None:
        self.calls.append(f"start_rpc_worker:{msg.job_id}")

    async def on_stop_rpc_worker(self, msg: pb.StopRpcWorker, send: Send) -> None:
        self.calls.append(f"stop_rpc_worker:{msg.job_id}")

    async def on_stop_server(self, msg: pb.StopServer) -> None:
        self.calls.append(f"stop_server:{msg.reason}")

    async def on_cancel(self, msg: pb.CancelJob, send: Send) -> None:
        self.calls.append(f"cancel:{msg.job_id}")

    async def on_drain(self, send: Send) -> None:
        self.calls.append("drain")
        self.drained.set()

    async def on_resume(self, send: Send) -> None:
        self.calls.append("resume")

    def active_job_ids(self) -> list[str]:
        return list(self.jobs)

    async def close(self) -> None:
        self.closed = True


def make_config(tmp_path: Path, url: str | None, **overrides: Any) -> AgentConfig:
    values: dict[str, Any] = {
        "data_dir": tmp_path / "agent-data",
        "node_name": "test-node",
        "controller_url": url,
        "enrollment_token": GOOD_TOKEN,
        "advertise_address": "127.0.0.1",
        "labels": {"zone": "lab"},
        "slots": 2,
        "heartbeat_interval": 0.1,
        "backoff_initial": 0.05,
        "insecure": True,  # the fake controller speaks plaintext
        "backoff_max": 0.2,
        "rpc_timeout": 3.0,
    }
    values.update(overrides)
    return AgentConfig(**values)


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(session: AgentSession) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(session.run())
    try:
        yield task
    finally:
        await session.stop()
        if task.done() and not task.cancelled():
            task.result()  # a fatal error the test did not expect
