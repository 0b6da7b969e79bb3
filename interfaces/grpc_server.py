"""The gRPC control channel: ``Enroll`` and one bidirectional ``Connect`` stream per agent.

Each upstream message becomes an application command (run in a worker thread, since the
event store is synchronous); heartbeats only touch live state. Downstream messages for a
node go through :class:`AgentConnections`, which any thread may call.

A stream the agent ends with ``Goodbye`` (it stops) takes the node OFFLINE at once and its
jobs with it. A stream that breaks (a reset, a keepalive timeout) takes nothing: the
node's jobs wait for it to reconnect, which its ``Welcome`` then resumes (the agent re-sends
what was lost), until the health sweep finds it silent for ``OFFLINE_AFTER``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, Protocol

import grpc

from application.agent_messages import Rejection
from application.background import BackgroundTasks
from application.controller import Controller
from application.enrollment import EnrollmentNotConfigured, EnrollmentService, Unauthenticated
from application.errors import TokenAlreadyUsed, TokenRevoked
from application.ports import LiveState
from application.rejections import RejectionAudit
from application.version import CONTROLLER_VERSION
from domain.access_refusal import CONNECT, ENROLL
from domain.enrollment_token import (
    BadSignatureError,
    ExpiredTokenError,
    InvalidTokenError,
    NodeMismatchError,
)
from domain.errors import DomainError
from domain.placement import address_allowed
from domain.states import NodeState
from interfaces.grpc_convert import (
    heartbeat_to_dict,
    inventory_to_dict,
    local_models_to_list,
    resources_from_report,
)
from proto import DEFAULT_ALLOWED_PEER_CIDRS, MAX_CONTROL_MESSAGE_BYTES, SLOTS_LABEL
from proto import control_pb2 as pb
from proto import control_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: Issues a node its certificate for a signing request (PEM in, PEM out; ValueError if bad).
NodeCertificates = Callable[[str, bytes], bytes]

_CLOSE = object()

#: How long a connecting agent has to send its Hello.
HELLO_TIMEOUT_SECONDS = 10.0


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.5:4242``, ``ipv6:[::1]:4242``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return ""


def _int_label(labels: Any, key: str, default: int) -> int:
    try:
        return max(default, int(labels.get(key, default)))
    except (TypeError, ValueError):
        return default


def _said_goodbye(reader: asyncio.Task[bool] | None) -> bool:
    """Whether the node's stream ended because the agent closed it (see ``_read``)."""
    return reader is not None and reader.done() and not reader.cancelled() and reader.result()


class AgentConnections:
    """The open ``Connect`` streams, by node id: the controller's way down to agents."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def open(self, node_id: str) -> asyncio.Queue[Any]:
        old = self._queues.get(node_id)
        if old is not None:
            old.put_nowait(_CLOSE)  # a newer stream replaces the old one
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[node_id] = queue
        return queue

    def close(self, node_id: str, queue: asyncio.Queue[Any]) -> bool:
        """Forgets the stream; True when it was still the node's current one."""
        if self._queues.get(node_id) is queue:
            del self._queues[node_id]
            return True
        return False

    def disconnect(self, node_id: str) -> bool:
        """Ends the node's stream from this side (the node was revoked); True if it had one."""
        queue = self._queues.get(node_id)
        if queue is None:
            return False
        queue.put_nowait(_CLOSE)
        return True

    def is_connected(self, node_id: str) -> bool:
        return node_id in self._queues

    def connected(self) -> list[str]:
        return list(self._queues)

    def send(self, node_id: str, message: pb.ControllerMessage) -> bool:
        queue = self._queues.get(node_id)
        if queue is None or self._loop is None:
            return False
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            queue.put_nowait(message)
        else:
            self._loop.call_soon_threadsafe(queue.put_nowait, message)
        return True


class UplinkHandler(Protocol):
    """Receives the job-related messages agents send up (the job manager)."""

    async def on_agent_message(
        self, node_id: str, message: pb.AgentMessage
    ) -> Rejection | None: ...

    async def on_node_disconnected(self, node_id: str) -> None: ...

    async def on_node_gone(self, node_id: str) -> None: ...

    def resumed_jobs(self, node_id: str) -> list[tuple[str, int]]: ...


class ControlPlaneServicer(pb_grpc.ControlPlaneServicer):
    def __init__(
        self,
        *,
        app: Controller,
        enrollment: EnrollmentService,
        live: LiveState,
        connections: AgentConnections,
        heartbeat_interval: float,
        uplink: UplinkHandler | None = None,
        clock: Callable[[], float] = time.time,
        allowed_cidrs: tuple[str, ...] = DEFAULT_ALLOWED_PEER_CIDRS,
        allow_nat: bool = False,
        node_certificates: NodeCertificates | None = None,
    ) -> None:
        self.allowed_cidrs = allowed_cidrs
        #: Issues each node its certificate (None: the controller cannot, and says so).
        self.node_certificates = node_certificates
        self.allow_nat = allow_nat
        #: At most one ACCESS_REFUSED per source address every 10 s.
        self._refusals = RejectionAudit()
        self.app = app
        self.enrollment = enrollment
        self.live = live
        self.connections = connections
        self.heartbeat_interval = heartbeat_interval
        self.uplink = uplink
        self.clock = clock
        self._cleanups = BackgroundTasks("handling a node message")
        self._rejections = RejectionAudit()
        #: Refused agent messages by the refused message's kind (for /metrics).
        self.rejected: Counter[str] = Counter()
        #: How long a connecting agent has to send its Hello.
        self.hello_timeout = HELLO_TIMEOUT_SECONDS
        #: The nodes revoked so far (Welcome names them: file servers refuse them).
        self.revoked_nodes: Callable[[], list[str]] = list

    # ----------------------------------------------------------------- Enroll

    async def Enroll(
        self, request: pb.EnrollRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EnrollResponse:
        name = request.node_name.strip()
        source = peer_host(context.peer() or "")
        if not name:
            await self._refuse(
                context,
                ENROLL,
                source,
                grpc.StatusCode.INVALID_ARGUMENT,
                "node_name must not be empty",
            )
        inv = request.inventory
        address = inv.advertised_address or source
        try:
            # The token first (no store needed): a caller without one learns nothing of the
            # address rules.
            self.enrollment.verify(request.enrollment_token, name, self.clock())
            violation = self._address_violation(address, source)
            if violation is not None:
                await self._refuse(
                    context,
                    ENROLL,
                    source,
                    grpc.StatusCode.PERMISSION_DENIED,
                    violation,
                    node_name=name,
                    security_violation=True,
                )
            enrolled = await asyncio.to_thread(
                self.enrollment.enroll,
                token=request.enrollment_token,
                name=name,
                inventory=inventory_to_dict(inv),
                agent_version=request.agent_version,
                address=address,
                rpc_port=inv.rpc_port or 50052,
                labels=dict(inv.labels),
                slots=_int_label(inv.labels, SLOTS_LABEL, 1),
                now=self.clock(),
            )
        except (BadSignatureError, ExpiredTokenError, InvalidTokenError) as e:
            code = (
                grpc.StatusCode.PERMISSION_DENIED
                if isinstance(e, NodeMismatchError)
                else grpc.StatusCode.UNAUTHENTICATED
            )
            await self._refuse(context, ENROLL, source, code, str(e), node_name=name)
        except TokenAlreadyUsed as e:
            await self._refuse(
                context, ENROLL, source, grpc.StatusCode.ALREADY_EXISTS, str(e), node_name=name
            )
        except TokenRevoked as e:
            await self._refuse(
                context, ENROLL, source, grpc.StatusCode.PERMISSION_DENIED, str(e), node_name=name
            )
        except EnrollmentNotConfigured as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (DomainError, ValueError) as e:
            await self._refuse(
                context, ENROLL, source, grpc.StatusCode.INVALID_ARGUMENT, str(e), node_name=name
            )
        log.info("node %s enrolled as %s", name, enrolled.node_id)
        return pb.EnrollResponse(
            node_id=str(enrolled.node_id),
            node_credential=enrolled.credential,
            controller_version=CONTROLLER_VERSION,
            heartbeat_interval_seconds=self.heartbeat_interval,
        )

    # ---------------------------------------------------------------- Connect

    async def Connect(
        self,
        request_iterator: AsyncIterator[pb.AgentMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ControllerMessage]:
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        node_id = metadata.get("x-node-id", "")
        # The Hello is read before the credential is judged: a refusal sent while the agent
        # is still writing its Hello reaches it as the client's own INTERNAL write error
        # instead of the refusal's status, and the agent would take a bad credential for a
        # transient fault.
        iterator = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(iterator.__anext__(), self.hello_timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no Hello within {self.hello_timeout:g} s of connecting",
            )
        try:
            node = await asyncio.to_thread(
                self.enrollment.authenticate, node_id, metadata.get("x-node-credential", "")
            )
        except Unauthenticated as e:
            source = peer_host(context.peer() or "")
            await self._refuse(
                context, CONNECT, source, grpc.StatusCode.UNAUTHENTICATED, str(e), node_id=node_id
            )
        node_id = str(node.id)
        if first.WhichOneof("payload") != "hello":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "first message must be Hello")
        if first.hello.node_id and first.hello.node_id != node_id:
            await self._refuse(
                context,
                CONNECT,
                peer_host(context.peer() or ""),
                grpc.StatusCode.PERMISSION_DENIED,
                f"credential of node {node_id} cannot speak for node {first.hello.node_id}",
                node_id=first.hello.node_id,
                security_violation=True,
            )
        queue = self.connections.open(node_id)
        reader: asyncio.Task[bool] | None = None
        try:
            self.live.mark_connected(node_id, True, self.clock())
            await asyncio.to_thread(self._on_hello, node_id, node.state, first.hello.agent_version)
            welcome = await self._welcome(node_id)
            welcome.node_certificate_pem = self._node_certificate(node_id, first.hello.csr_pem)
            yield pb.ControllerMessage(welcome=welcome)
            reader = asyncio.create_task(self._read(node_id, iterator, queue))
            while True:
                item = await queue.get()
                if item is _CLOSE:
                    break
                yield item
        finally:
            said_goodbye = _said_goodbye(reader)
            if reader is not None:
                reader.cancel()
            if self.connections.close(node_id, queue):
                # gRPC cancels this handler when the client cancels the call; the clean-up
                # (node offline, its jobs re-planned or failed) must run to its end anyway.
                cleanup = self._cleanups.spawn(self._on_stream_closed(node_id, said_goodbye))
                await asyncio.shield(cleanup)

    def _node_certificate(self, node_id: str, csr_pem: str) -> str:
        """The node's certificate for its signing request ("" when it sent none, or when it
        cannot be issued: the agent then serves and fetches no model files)."""
        if not csr_pem:
            return ""
        if self.node_certificates is None:
            log.info(
                "node %s asked for a certificate; this controller cannot issue one (no TLS, "
                "or its TLS files are the operator's, without the CA key)",
                node_id,
            )
            return ""
        try:
            return self.node_certificates(node_id, csr_pem.encode()).decode()
        except ValueError as e:
            log.warning("node %s: no certificate issued: %s", node_id, e)
            return ""

    async def _welcome(self, node_id: str) -> pb.Welcome:
        """The node's Welcome, naming the jobs that go on over this stream. What the node
        answered on an earlier stream may be lost, so the setups waiting for it fail over
        first (a new stream can replace one the controller has not seen die yet)."""
        resumed: list[tuple[str, int]] = []
        if self.uplink is not None:
            await self.uplink.on_node_disconnected(node_id)
            resumed = self.uplink.resumed_jobs(node_id)
        if resumed:
            log.info("node %s is back: %d job(s) resume", node_id, len(resumed))
        return pb.Welcome(
            controller_version=CONTROLLER_VERSION,
            node_id=node_id,
            heartbeat_interval_seconds=self.heartbeat_interval,
            resumed_jobs=[pb.ResumedJob(job_id=j, next_seq=seq) for j, seq in resumed],
            revoked_node_ids=self.revoked_nodes(),
        )

    def _address_violation(self, address: str, source: str) -> str | None:
        """Why an enrolling agent's advertised address is refused, if it is: outside
        ALLOWED_PEER_CIDRS, or (unless ENROLL_ALLOW_NAT) not the address it connects from."""
        if not address_allowed(address, self.allowed_cidrs):
            return (
                f"security violation: advertised address {address!r} is outside "
                f"ALLOWED_PEER_CIDRS ({', '.join(self.allowed_cidrs)})"
            )
        if not self.allow_nat and source and address != source:
            return (
                f"security violation: advertised address {address} is not the address the "
                f"agent connects from ({source}); pass --advertise-address {source}, or set "
                "ENROLL_ALLOW_NAT=true on the controller if it sits behind NAT"
            )
        return None

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        kind: str,
        source: str,
        code: grpc.StatusCode,
        reason: str,
        *,
        node_name: str = "",
        node_id: str = "",
        security_violation: bool = False,
    ) -> NoReturn:
        """Refuses the call with ``code`` and records it (ACCESS_REFUSED; at most one per
        source address every 10 s, counting the rest)."""
        log.warning("%s from %s refused: %s", kind, source or "?", reason)
        suppressed = self._refusals.note(source, self.clock())
        if suppressed is not None:
            record = functools.partial(
                self.app.refuse_access,
                kind=kind,
                source=source,
                reason=reason,
                node_name=node_name,
                node_id=node_id,
                security_violation=security_violation,
                suppressed=suppressed,
            )
            self._cleanups.spawn(self._command(record))
        await context.abort(code, reason)
        raise AssertionError("unreachable: abort raises")

    def _on_hello(self, node_id: str, state: str, agent_version: str) -> None:
        try:
            if state == NodeState.REGISTERING:
                self.app.mark_ready(node_id)
            elif state in (NodeState.DEGRADED, NodeState.OFFLINE, NodeState.ERROR):
                self.app.mark_recovered(node_id, agent_version)
        except DomainError as e:
            log.info("node %s connected in state %s: %s", node_id, state, e)

    async def _read(
        self, node_id: str, iterator: AsyncIterator[pb.AgentMessage], queue: asyncio.Queue[Any]
    ) -> bool:
        """Handles the node's messages until its stream ends; True when the agent said
        goodbye, False when the stream broke."""
        goodbye = False
        try:
            async for message in iterator:
                try:
                    if not await self._on_message(node_id, message):
                        goodbye = True
                        break
                except Exception:
                    # A store or Redis hiccup must not cost the node its control stream.
                    log.exception(
                        "handling %s from node %s failed", message.WhichOneof("payload"), node_id
                    )
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        except Exception:
            log.exception("control stream of node %s failed", node_id)
        finally:
            queue.put_nowait(_CLOSE)
        return goodbye

    async def _on_message(self, node_id: str, message: pb.AgentMessage) -> bool:
        """Handles one message; False when it was the agent's goodbye (the stream ends). A
        message that breaks the protocol is refused alone (:meth:`_reject`)."""
        kind = message.WhichOneof("payload")
        if message.ByteSize() > MAX_CONTROL_MESSAGE_BYTES:
            size = message.ByteSize()
            why = f"{size} bytes, more than the {MAX_CONTROL_MESSAGE_BYTES} a message may have"
            self._reject(node_id, kind or "", Rejection(why))
        elif kind == "heartbeat":
            telemetry = heartbeat_to_dict(message.heartbeat)
            self.live.record_heartbeat(node_id, telemetry, self.clock())
        elif kind == "resource_report":
            live = self.live.get(node_id)
            ram_free = live.telemetry.get("ram_free_bytes") if live else None
            try:
                resources = resources_from_report(message.resource_report.inventory, ram_free)
                models = local_models_to_list(message.resource_report.models)
            except (ValueError, TypeError) as e:
                self._reject(node_id, kind, Rejection(f"a malformed resource report: {e}"))
                return True
            # Store writes run beside the message loop: a slow store must not hold up the
            # node's heartbeats (nor its jobs' tokens) behind them; a failure is logged and
            # never costs the node its control stream.
            self._cleanups.spawn(
                self._command(self.app.report_resources, node_id, resources, models)
            )
        elif kind == "runtime_fault":
            if message.runtime_fault.fatal:
                fault = message.runtime_fault.message
                self._cleanups.spawn(self._command(self.app.report_node_error, node_id, fault))
            else:
                log.warning("node %s reports: %s", node_id, message.runtime_fault.message)
        elif kind == "goodbye":
            log.info("node %s says goodbye: %s", node_id, message.goodbye.reason or "stopping")
            return False
        elif kind == "hello":
            self._reject(node_id, kind, Rejection("a second Hello on one stream"))
        elif kind is None:
            why = "an empty message, or one of a kind this controller does not know"
            self._reject(node_id, "", Rejection(why))
        elif self.uplink is not None:
            rejection = await self.uplink.on_agent_message(node_id, message)
            if rejection is not None:
                self._reject(node_id, kind, rejection)
        else:
            log.warning("node %s sent %s but no job manager is running", node_id, kind)
        return True

    def _reject(self, node_id: str, kind: str, rejection: Rejection) -> None:
        """Refuses one message: the agent hears why (``MessageRejected``) and its stream goes
        on; /metrics counts it; NODE_MESSAGE_REJECTED records it (at most one per node every
        10 s, see :class:`RejectionAudit`)."""
        log.warning(
            "node %s: %s refused (job %s): %s",
            node_id,
            kind or "message",
            rejection.job_id or "-",
            rejection.reason,
        )
        self.rejected[kind or "unknown"] += 1
        refused = pb.MessageRejected(kind=kind, job_id=rejection.job_id, reason=rejection.reason)
        self.connections.send(node_id, pb.ControllerMessage(message_rejected=refused))
        suppressed = self._rejections.note(node_id, self.clock())
        if suppressed is not None:
            record = self.app.reject_message
            args = (node_id, kind, rejection.job_id, rejection.reason, suppressed)
            self._cleanups.spawn(self._command(record, *args))

    async def _command(self, fn: Callable[..., object], *args: Any) -> None:
        try:
            await asyncio.to_thread(fn, *args)
        except DomainError as e:
            log.info("command %s refused: %s", getattr(fn, "__name__", fn), e)

    async def _on_stream_closed(self, node_id: str, said_goodbye: bool) -> None:
        """The stream is gone: each step runs even when an earlier one failed. An agent that
        said goodbye is offline now; a broken stream leaves the node's jobs waiting for it
        to reconnect (the health sweep takes it offline if it stays silent)."""
        try:
            self.live.mark_connected(node_id, False, self.clock())
        except Exception:
            log.exception("could not mark node %s disconnected in live state", node_id)
        if self.uplink is not None:
            try:
                await self.uplink.on_node_disconnected(node_id)
                if said_goodbye:
                    await self.uplink.on_node_gone(node_id)
            except Exception:
                log.exception("job clean-up after node %s disconnected failed", node_id)
        if not said_goodbye:
            log.warning(
                "the control stream of node %s broke; its jobs wait for it to reconnect",
                node_id,
            )
            return
        try:
            await self._command(self.app.mark_offline, node_id, "control stream closed")
        except Exception:
            log.exception("could not record node %s offline; the health sweep will", node_id)
