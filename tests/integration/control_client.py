"""A minimal raw control-channel client for tests (speaks the real gRPC protocol), and the
one way tests reach a controller's control channel: :class:`ControlTarget` (TLS with the
controller's CA, as agents do after pinning it; plaintext only for the agent tests' fake
controller)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from bench.synthetic_agents import wire_inventory
from common.contract import AGENT_RECEIVE_BYTES, CONTROLLER_RECEIVE_BYTES, CONTROLLER_TLS_NAME
from interfaces.controller_main import RunningController
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class ControlTarget:
    """Where a controller's control channel is, and the CA to verify it with."""

    address: str
    ca_pem: bytes | None = None  # None: plaintext (only the agent tests' fake controller)
    server_name: str = CONTROLLER_TLS_NAME

    def channel(self) -> grpc.aio.Channel:
        """A channel with the limits a real agent sets (a plan may be as large as a request)."""
        limits: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", AGENT_RECEIVE_BYTES),
            ("grpc.max_send_message_length", 2 * CONTROLLER_RECEIVE_BYTES),  # oversize tests
        ]
        if self.ca_pem is None:
            return grpc.aio.insecure_channel(self.address, options=limits)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.ca_pem)
        options = [*limits, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.aio.secure_channel(self.address, credentials, options=options)


def control_target(ctl: RunningController, address: str | None = None) -> ControlTarget:
    """The controller's control channel (at ``address`` instead, e.g. through a proxy)."""
    tls = ctl.services.tls
    return ControlTarget(
        address or f"127.0.0.1:{ctl.grpc_port}",
        tls.ca_pem if tls is not None else None,
        tls.server_name if tls is not None else CONTROLLER_TLS_NAME,
    )


Target = ControlTarget | str  # a plain address: plaintext


def as_target(target: Target) -> ControlTarget:
    return target if isinstance(target, ControlTarget) else ControlTarget(target)


def inventory(address: str = "127.0.0.1", ram: int = 8 << 30) -> pb.Inventory:
    return wire_inventory(hostname="test-host", cpu_model="test cpu", ram=ram, address=address)


async def enroll(
    target: Target, token: str, name: str, address: str = "127.0.0.1"
) -> pb.EnrollResponse:
    async with as_target(target).channel() as channel:
        stub = pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
        response: pb.EnrollResponse = await stub.Enroll(
            pb.EnrollRequest(
                enrollment_token=token,
                node_name=name,
                agent_version="test",
                inventory=inventory(address),
            )
        )
        return response


class RawSession:
    """An open Connect stream: send messages up, read what comes down."""

    def __init__(self, target: Target, node_id: str, credential: str, hello_id: str | None = None):
        self.target = as_target(target)
        self.node_id = node_id
        self.credential = credential
        self.hello_id = node_id if hello_id is None else hello_id
        self.outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self.received: list[pb.ControllerMessage] = []
        self.channel: grpc.aio.Channel | None = None
        self.call: Any = None
        self._beat: asyncio.Task[None] | None = None
        self._read: asyncio.Task[None] | None = None
        self.error: grpc.aio.AioRpcError | None = None
        self.final_code: grpc.StatusCode | None = None

    async def _requests(self) -> AsyncIterator[pb.AgentMessage]:
        yield pb.AgentMessage(hello=pb.Hello(agent_version="test", node_id=self.hello_id))
        while True:
            item = await self.outbox.get()
            if item is None:
                return
            yield item

    async def open(self) -> pb.ControllerMessage:
        self.channel = self.target.channel()
        stub = pb_grpc.ControlPlaneStub(self.channel)  # type: ignore[no-untyped-call]
        metadata = (("x-node-id", self.node_id), ("x-node-credential", self.credential))
        self.call = stub.Connect(self._requests(), metadata=metadata)
        try:
            first: pb.ControllerMessage = await self.call.read()
        except grpc.aio.AioRpcError:
            # When the server refuses at once, the client's own write of Hello may fail
            # first (INTERNAL); the call's final status is the server's answer.
            self.final_code = await self.call.code()
            raise
        self.received.append(first)
        self._read = asyncio.create_task(self._reader())
        return first

    async def _reader(self) -> None:
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:  # type: ignore[attr-defined]
                    return
                self.received.append(message)
        except grpc.aio.AioRpcError as e:
            self.error = e

    async def send(self, message: pb.AgentMessage) -> None:
        await self.outbox.put(message)

    def start_heartbeats(self, interval: float = 0.2) -> None:
        async def beat() -> None:
            while True:
                await self.send(
                    pb.AgentMessage(
                        heartbeat=pb.Heartbeat(
                            sent_at_unix_ms=int(time.time() * 1000),
                            cpu_percent=5.0,
                            ram_free_bytes=6 << 30,
                        )
                    )
                )
                await asyncio.sleep(interval)

        self._beat = asyncio.create_task(beat())

    def stop_heartbeats(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None

    async def close(self, reason: str = "test session closed") -> None:
        """Ends the stream as an agent that stops does: goodbye, then the call."""
        self.stop_heartbeats()
        await self.outbox.put(pb.AgentMessage(goodbye=pb.Goodbye(reason=reason)))
        await self.outbox.put(None)
        if self.call is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.call.code(), 5)
        await self.drop()

    async def drop(self) -> None:
        """Breaks the stream without a goodbye (a crashed agent, a reset link)."""
        self.stop_heartbeats()
        if self.call is not None:
            self.call.cancel()
        if self._read is not None:
            self._read.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._read
        if self.channel is not None:
            await self.channel.close(None)
