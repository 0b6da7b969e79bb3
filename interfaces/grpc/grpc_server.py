"""The gRPC control channel: ``Enroll`` and one bidirectional ``Connect`` stream per agent.

Each upstream message becomes an application command (run in a worker thread, since the
event store is synchronous); heartbeats only touch live state. Downstream messages for a
node go through :class:`AgentConnections`, which any thread may call.

An agent asked to stop first sends ``Stopping`` (NODE_STOPPING: the node drains, no new job
goes to it), then, its jobs ended, ``Goodbye``. A stream the agent ends with ``Goodbye``
takes the node OFFLINE at once (NODE_STOPPED) and the jobs it still holds with it. A stream
that breaks (a reset, a keepalive timeout) takes nothing: the node's jobs wait for it to
reconnect, which its ``Welcome`` then resumes (the agent re-sends what was lost), until the
health sweep finds it silent for ``OFFLINE_AFTER``.

What one caller may cost is bounded (docs/control-channel.md, "The Connect stream", and
docs/faults.md, "Bad messages from an agent"): a caller without credentials is answered from
memory, within HELLO_TIMEOUT_SECONDS, and only PENDING_PER_SOURCE of its streams (PENDING_TOTAL
of all) are read at once; an enrolled node's outbox is bounded (a node that does not read is
disconnected, not buffered), the strings it sends are cut before anything records or logs them,
and its refused messages, resource reports and faults are rate-limited.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from application.agent_messages import Rejection
from application.background import BackgroundTasks
from application.controller import Controller
from application.enrollment import EnrollmentNotConfigured, EnrollmentService, Unauthenticated
from application.errors import TokenAlreadyUsed, TokenRevoked
from application.ports import LiveState, UplinkHandler
from application.rejections import PendingGate, RateBudget, RejectionAudit
from application.version import CONTROLLER_VERSION
from common.contract import (
    AGENT_RECEIVE_BYTES,
    DEFAULT_ALLOWED_PEER_CIDRS,
    DEFAULT_RPC_PORT,
    MAX_CONTROL_MESSAGE_BYTES,
    SLOTS_LABEL,
)
from domain.access_refusal import CONNECT, ENROLL
from domain.bounded_text import ID_MAX, NODE_NAME_MAX, TEXT_MAX, bounded, node_name_problem
from domain.enrollment_token import (
    BadSignatureError,
    ExpiredTokenError,
    InvalidTokenError,
    NodeMismatchError,
)
from domain.errors import DomainError
from domain.placement import address_allowed
from domain.states import NodeState
from interfaces.grpc.grpc_convert import (
    MAX_LABELS,
    clamp_strings,
    heartbeat_to_dict,
    inventory_to_dict,
    local_models_to_list,
    resources_from_report,
)
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: Issues a node its certificate for a signing request (PEM in, PEM out; ValueError if bad).
NodeCertificates = Callable[[str, bytes], bytes]

_CLOSE = object()

#: How long a connecting caller has to send its Hello (s); an agent sends it at once.
HELLO_TIMEOUT_SECONDS = 2.0
#: The largest Hello (bytes): a version, a node id and a certificate signing request.
MAX_HELLO_BYTES = 64 * 1024
#: The longest enrollment token read (characters; a real one is a few hundred).
MAX_TOKEN_CHARS = 4096
#: Control streams not yet authenticated (their Hello being read, their credential checked)
#: at once: from one address, and in all. More wait for their turn, up to HELLO_TIMEOUT_SECONDS
#: and so many of them (from one address, in all); then, or beyond those, RESOURCE_EXHAUSTED.
#: Waiting, a stream is not read: what its caller sent stays within gRPC's flow-control window.
PENDING_PER_SOURCE = 4
PENDING_TOTAL = 32
WAITING_PER_SOURCE = 256
WAITING_TOTAL = 1024
#: Calls the gRPC server serves at once (each connected node's stream is one).
MAX_CONCURRENT_RPCS = 2048
#: What may wait to be sent down one node's stream: beyond either, the node is not reading
#: its stream, which is closed (as if it broke: the node's jobs wait for it to reconnect).
OUTBOX_MAX_MESSAGES = 4096
OUTBOX_MAX_BYTES = 4 * AGENT_RECEIVE_BYTES
#: Per node: refused messages answered and logged (a burst, then so many per second); the
#: rest are counted (/metrics, and the next NODE_MESSAGE_REJECTED's ``suppressed``).
REJECTION_BURST, REJECTION_RATE = 20, 2.0
#: Per node: a resource report is recorded at most once this often (s); one that comes sooner
#: waits for the interval's end, and a newer one replaces it meanwhile.
REPORT_INTERVAL = 1.0
#: Per node: runtime faults recorded (fatal) or logged (a burst, then so many per second).
FAULT_BURST, FAULT_RATE = 5, 0.2
#: Why an agent stopped when its Goodbye does not say.
GOODBYE_REASON = "the agent is stopping"
#: How long a node's NODE_STOPPED waits for its NODE_STOPPING to be written (s).
STOPPING_WRITE_TIMEOUT = 10.0
#: ACCESS_REFUSED recorded in all, whatever the number of source addresses (a burst, then
#: so many per second); the rest are counted in /metrics only.
REFUSAL_RECORD_BURST, REFUSAL_RECORD_RATE = 30, 1.0


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


class Outbox:
    """What waits to be sent down one node's stream: at most ``max_messages`` messages and
    ``max_bytes`` bytes. One more means the node does not read its stream: what waits is
    dropped and the stream closes (:attr:`overflowed`); nothing more is taken."""

    def __init__(
        self, max_messages: int = OUTBOX_MAX_MESSAGES, max_bytes: int = OUTBOX_MAX_BYTES
    ) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._queue: asyncio.Queue[tuple[Any, int]] = asyncio.Queue()
        self.bytes = 0
        self.closed = False
        self.overflowed = False

    def put(self, message: pb.ControllerMessage) -> bool:
        """Queues ``message``; False when the stream is closing, or closes now (overflow)."""
        if self.closed:
            return False
        size = message.ByteSize()
        if self._queue.qsize() >= self.max_messages or self.bytes + size > self.max_bytes:
            self.overflowed = True
            while not self._queue.empty():
                self._queue.get_nowait()
            self.bytes = 0
            self.close()
            return False
        self.bytes += size
        self._queue.put_nowait((message, size))
        return True

    def close(self) -> None:
        """Ends the stream once what waits before this is sent."""
        if not self.closed:
            self.closed = True
            self._queue.put_nowait((_CLOSE, 0))

    async def get(self) -> Any:
        """The next message, or ``_CLOSE``."""
        item, size = await self._queue.get()
        self.bytes -= size
        return item

    def qsize(self) -> int:
        return self._queue.qsize()


class AgentConnections:
    """The open ``Connect`` streams, by node id: the controller's way down to agents."""

    def __init__(
        self, max_messages: int = OUTBOX_MAX_MESSAGES, max_bytes: int = OUTBOX_MAX_BYTES
    ) -> None:
        self._queues: dict[str, Outbox] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        #: Streams closed because their node did not read them (for /metrics).
        self.overflows = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def open(self, node_id: str) -> Outbox:
        old = self._queues.get(node_id)
        if old is not None:
            old.close()  # a newer stream replaces the old one
        queue = Outbox(self.max_messages, self.max_bytes)
        self._queues[node_id] = queue
        return queue

    def close(self, node_id: str, queue: Outbox) -> bool:
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
        queue.close()
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
            return self._put(node_id, queue, message)
        self._loop.call_soon_threadsafe(self._put, node_id, queue, message)
        return True

    def _put(self, node_id: str, queue: Outbox, message: pb.ControllerMessage) -> bool:
        if queue.closed:
            return False
        if queue.put(message):
            return True
        self.overflows += 1  # it overflowed just now
        log.warning(
            "node %s does not read its control stream (more than %d messages or %d bytes wait "
            "for it): the stream is closed, and its jobs wait for it to reconnect",
            node_id,
            queue.max_messages,
            queue.max_bytes,
        )
        return False


@dataclass
class _Reports:
    """A node's resource reports: when the last was recorded (loop time), the one waiting."""

    last: float = -REPORT_INTERVAL
    waiting: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    timer: asyncio.TimerHandle | None = None


class ControlPlaneServicer(pb_grpc.ControlPlaneServicer):
    def __init__(
        self,
        *,
        app: Controller,
        enrollment: EnrollmentService,
        live: LiveState,
        connections: AgentConnections,
        heartbeat_interval: float,
        uplink: UplinkHandler[pb.AgentMessage] | None = None,
        clock: Callable[[], float] = time.time,
        allowed_cidrs: tuple[str, ...] = DEFAULT_ALLOWED_PEER_CIDRS,
        allow_nat: bool = False,
        node_certificates: NodeCertificates | None = None,
        revoked_nodes: Callable[[], list[str]] = list,
    ) -> None:
        self.allowed_cidrs = allowed_cidrs
        #: Issues each node its certificate (None: the controller cannot, and says so).
        self.node_certificates = node_certificates
        self.allow_nat = allow_nat
        #: At most one ACCESS_REFUSED per source address every 10 s, and so many in all.
        self._refusals = RejectionAudit()
        self._refusal_records = RateBudget(REFUSAL_RECORD_RATE, REFUSAL_RECORD_BURST)
        #: Streams whose caller is not authenticated yet, per source address and in all.
        self._pending = PendingGate(
            PENDING_PER_SOURCE,
            PENDING_TOTAL,
            waiting_per_key=WAITING_PER_SOURCE,
            waiting_total=WAITING_TOTAL,
        )
        self.app = app
        self.enrollment = enrollment
        self.live = live
        self.connections = connections
        self.heartbeat_interval = heartbeat_interval
        self.uplink = uplink
        self.clock = clock
        self._cleanups = BackgroundTasks("handling a node message")
        self._rejections = RejectionAudit()
        #: Per node: refusals answered, faults acted on.
        self._answered = RateBudget(REJECTION_RATE, REJECTION_BURST)
        self._faults = RateBudget(FAULT_RATE, FAULT_BURST)
        #: Per node: when its last resource report was recorded, and the one waiting.
        self._reports: dict[str, _Reports] = {}
        #: Refused agent messages by the refused message's kind (for /metrics).
        self.rejected: Counter[str] = Counter()
        #: Refused Enroll and Connect calls by (kind, status code name) (for /metrics).
        self.refused: Counter[tuple[str, str]] = Counter()
        #: Node messages over their node's budget, by kind, not acted on (for /metrics).
        self.over_budget: Counter[str] = Counter()
        #: How long a connecting caller has to send its Hello.
        self.hello_timeout = HELLO_TIMEOUT_SECONDS
        #: The nodes revoked so far (Welcome names them: file servers refuse them).
        self.revoked_nodes = revoked_nodes
        #: Per node: why its agent said goodbye, until its stream's clean-up reads it.
        self._goodbyes: dict[str, str] = {}
        #: Per node: the write of its NODE_STOPPING, which its NODE_STOPPED must follow.
        self._stopping: dict[str, asyncio.Future[None]] = {}

    # ----------------------------------------------------------------- Enroll

    async def Enroll(
        self, request: pb.EnrollRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EnrollResponse:
        name = request.node_name.strip()
        source = peer_host(context.peer() or "")
        # The name first: what is recorded of a refused caller is checked before anything is.
        problem = node_name_problem(name)
        if problem is not None:
            await self._refuse(
                context,
                ENROLL,
                source,
                grpc.StatusCode.INVALID_ARGUMENT,
                problem,
                node_name=bounded(name, NODE_NAME_MAX),
            )
        if len(request.enrollment_token) > MAX_TOKEN_CHARS:
            why = f"enrollment token is malformed ({len(request.enrollment_token)} characters)"
            await self._refuse(
                context, ENROLL, source, grpc.StatusCode.UNAUTHENTICATED, why, node_name=name
            )
        inv = request.inventory
        clamp_strings(inv)
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
            if len(inv.labels) > MAX_LABELS:
                raise ValueError(f"{len(inv.labels)} labels; a node may have {MAX_LABELS}")
            enrolled = await asyncio.to_thread(
                self.enrollment.enroll,
                token=request.enrollment_token,
                name=name,
                inventory=inventory_to_dict(inv),
                agent_version=bounded(request.agent_version, ID_MAX),
                address=address,
                rpc_port=inv.rpc_port or DEFAULT_RPC_PORT,
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
        admitted = await self._admit(context)
        if admitted is None:
            return  # authenticated, but the agent ended its stream before its Hello
        node_id, hello = admitted
        queue = self.connections.open(node_id)
        if self.enrollment.is_revoked(node_id):  # revoked while the credential was checked
            self.connections.close(node_id, queue)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"node {node_id} was revoked")
        reader: asyncio.Task[bool] | None = None
        try:
            self.live.mark_connected(node_id, True, self.clock())
            await asyncio.to_thread(self._on_hello, node_id, hello.agent_version)
            welcome = await self._welcome(node_id)
            welcome.node_certificate_pem = self._node_certificate(node_id, hello.csr_pem)
            yield pb.ControllerMessage(welcome=welcome)
            reader = asyncio.create_task(self._read(node_id, request_iterator, queue))
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

    async def _admit(
        self, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tuple[str, pb.Hello] | None:
        """The node a new stream speaks for, and its Hello; refuses the call otherwise.

        The Hello is read before the credential is judged: a refusal sent while the agent
        is still writing its Hello reaches it as the client's own INTERNAL write error
        instead of the refusal's status, and the agent would take a bad credential for a
        transient fault. So every caller is read first, briefly (``hello_timeout``), and only
        PENDING_PER_SOURCE callers of one address (PENDING_TOTAL in all) at once, the others
        waiting their turn as long (a refusal after that wait finds a Hello of a normal size
        written); the credential is then checked from memory
        (:meth:`EnrollmentService.authenticate`)."""
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        claimed = metadata.get("x-node-id", "")
        source = peer_host(context.peer() or "")
        if not await self._pending.enter(source, self.hello_timeout):
            self.refused[(CONNECT, grpc.StatusCode.RESOURCE_EXHAUSTED.name)] += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many control streams from {source or '?'} are being opened at once; "
                "try again",
            )
        try:
            # context.read(), not the request iterator: a refused stream's iterator would stay
            # suspended, holding its first message (up to CONTROLLER_RECEIVE_BYTES) for good.
            first: pb.AgentMessage | None = None
            read: object = None
            ended = False
            try:
                read = await asyncio.wait_for(context.read(), self.hello_timeout)
            except TimeoutError:
                pass
            else:
                if isinstance(read, pb.AgentMessage):
                    first = read
                else:
                    ended = True  # EOF: the caller closed its side
            try:
                node_id = await self.enrollment.authenticate(
                    claimed, metadata.get("x-node-credential", ""), self.clock()
                )
            except Unauthenticated as e:
                await self._refuse(
                    context,
                    CONNECT,
                    source,
                    grpc.StatusCode.UNAUTHENTICATED,
                    str(e),
                    node_id=bounded(claimed, ID_MAX),
                )
            except Exception as e:  # the store cannot say now (a node the cache lacks)
                log.warning("cannot check the credential of node %s: %r", claimed[:ID_MAX], e)
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "the controller cannot check this credential right now; try again",
                )
            if ended:
                return None
            if first is None:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no Hello within {self.hello_timeout:g} s of connecting",
                )
            size = first.ByteSize()
            if size > MAX_HELLO_BYTES:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a Hello of {size} bytes; it may have {MAX_HELLO_BYTES}",
                )
            if first.WhichOneof("payload") != "hello":
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, "first message must be Hello"
                )
            hello = first.hello
            clamp_strings(hello)
            if hello.node_id and hello.node_id != node_id:
                await self._refuse(
                    context,
                    CONNECT,
                    source,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"credential of node {node_id} cannot speak for node {hello.node_id}",
                    node_id=hello.node_id,
                    security_violation=True,
                )
            return node_id, hello
        finally:
            # A refusal's traceback may outlive the call: it must not hold what was read.
            first = read = None
            self._pending.leave(source)

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
        source address every 10 s, counting the rest, and REFUSAL_RECORD_RATE in all). What
        the caller sent is recorded and logged in its bounded form only."""
        reason = bounded(reason, TEXT_MAX)
        self.refused[(kind, code.name)] += 1
        log.warning("%s from %s refused: %s", kind, source or "?", reason)
        now = self.clock()
        suppressed = self._refusals.note(source, now)
        if suppressed is not None and self._refusal_records.take("", now):
            record = functools.partial(
                self.app.refuse_access,
                kind=kind,
                source=source,
                reason=reason,
                node_name=bounded(node_name, NODE_NAME_MAX),
                node_id=bounded(node_id, ID_MAX),
                security_violation=security_violation,
                suppressed=suppressed,
            )
            self._cleanups.spawn(self._command(record))
        await context.abort(code, reason)
        raise AssertionError("unreachable: abort raises")

    def _on_hello(self, node_id: str, agent_version: str) -> None:
        try:
            state = self.app.get_node(node_id).state
            if state == NodeState.REGISTERING:
                self.app.mark_ready(node_id)
            elif state in (NodeState.DEGRADED, NodeState.OFFLINE, NodeState.ERROR):
                self.app.mark_recovered(node_id, agent_version)
        except DomainError as e:
            log.info("node %s connected: %s", node_id, e)

    async def _read(
        self, node_id: str, iterator: AsyncIterator[pb.AgentMessage], queue: Outbox
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
            queue.close()
        return goodbye

    async def _on_message(self, node_id: str, message: pb.AgentMessage) -> bool:
        """Handles one message; False when it was the agent's goodbye (the stream ends). A
        message that breaks the protocol is refused alone (:meth:`_reject`). Its strings are
        cut to what may be recorded or logged first (:func:`clamp_strings`)."""
        kind = message.WhichOneof("payload")
        size = message.ByteSize()
        if size > MAX_CONTROL_MESSAGE_BYTES:
            why = f"{size} bytes, more than the {MAX_CONTROL_MESSAGE_BYTES} a message may have"
            self._reject(node_id, kind or "", Rejection(why))
            return True
        if kind == "token_chunk":  # the hot path: only its job id is kept beyond the relay
            if len(message.token_chunk.job_id) > ID_MAX:
                message.token_chunk.job_id = bounded(message.token_chunk.job_id, ID_MAX)
        elif kind != "heartbeat":
            clamp_strings(message)
        if kind == "heartbeat":
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
            self._report_resources(node_id, resources, models)
        elif kind == "runtime_fault":
            self._fault(node_id, message.runtime_fault)
        elif kind == "stopping":
            self._stop_draining(node_id, message.stopping)
        elif kind == "goodbye":
            reason = message.goodbye.reason or GOODBYE_REASON
            log.info("node %s says goodbye: %s", node_id, reason)
            self._goodbyes[node_id] = reason
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

    def _report_resources(
        self, node_id: str, resources: dict[str, Any], models: list[dict[str, Any]]
    ) -> None:
        """Records the report now, or at the end of the node's REPORT_INTERVAL (the newest
        one then). Store writes run beside the message loop: a slow store must not hold up
        the node's heartbeats (nor its jobs' tokens); a failure is logged and never costs the
        node its control stream."""
        loop = asyncio.get_running_loop()
        reports = self._reports.setdefault(node_id, _Reports())
        now = loop.time()
        if reports.timer is None and now - reports.last >= REPORT_INTERVAL:
            reports.last = now
            self._cleanups.spawn(
                self._command(self.app.report_resources, node_id, resources, models)
            )
            return
        if reports.waiting is not None:
            self.over_budget["resource_report"] += 1  # replaced by this newer one
        reports.waiting = (resources, models)
        if reports.timer is None:
            delay = max(0.0, reports.last + REPORT_INTERVAL - now)
            reports.timer = loop.call_later(delay, self._report_waiting, node_id)

    def _report_waiting(self, node_id: str) -> None:
        reports = self._reports[node_id]
        reports.timer = None
        if reports.waiting is not None:
            resources, models = reports.waiting
            reports.waiting = None
            reports.last = asyncio.get_running_loop().time()
            self._cleanups.spawn(
                self._command(self.app.report_resources, node_id, resources, models)
            )

    def _stop_draining(self, node_id: str, stopping: pb.Stopping) -> None:
        """The agent drains before it stops: NODE_STOPPING is recorded beside the message
        loop (the running jobs' tokens go on meanwhile); the node's NODE_STOPPED waits for it."""
        log.info(
            "node %s is stopping: draining %d job(s), at most %g s",
            node_id,
            len(stopping.running_job_ids),
            stopping.drain_timeout_seconds,
        )
        self._stopping[node_id] = self._cleanups.spawn(
            self._command(self.app.mark_stopping, node_id, stopping.drain_timeout_seconds)
        )

    def _fault(self, node_id: str, fault: pb.RuntimeFault) -> None:
        """A fatal fault is recorded (NODE_ERROR), another one logged: FAULT_BURST at once,
        then FAULT_RATE per second per node; the rest are counted only."""
        if not self._faults.take(node_id, self.clock()):
            self.over_budget["runtime_fault"] += 1
            return
        if fault.fatal:
            self._cleanups.spawn(self._command(self.app.report_node_error, node_id, fault.message))
        else:
            log.warning("node %s reports: %s", node_id, fault.message)

    def _reject(self, node_id: str, kind: str, rejection: Rejection) -> None:
        """Refuses one message: /metrics counts it; NODE_MESSAGE_REJECTED records it (at most
        one per node every 10 s, see :class:`RejectionAudit`); the agent hears why
        (``MessageRejected``) and its stream goes on, and the refusal is logged, for the
        first REJECTION_BURST and then REJECTION_RATE per second per node. Echoed, logged and
        recorded strings are bounded."""
        now = self.clock()
        job_id = bounded(rejection.job_id, ID_MAX)
        reason = bounded(rejection.reason, TEXT_MAX)
        self.rejected[kind or "unknown"] += 1
        suppressed = self._rejections.note(node_id, now)
        if suppressed is not None:
            unanswered = self._answered.dropped(node_id)
            if unanswered:
                log.warning(
                    "node %s: %d more refused messages were neither answered nor logged (more "
                    "than %g a second)",
                    node_id,
                    unanswered,
                    REJECTION_RATE,
                )
            record = self.app.reject_message
            args = (node_id, kind, job_id, reason, suppressed)
            self._cleanups.spawn(self._command(record, *args))
        if not self._answered.take(node_id, now):
            self.over_budget["message_rejected"] += 1
            return
        log.warning(
            "node %s: %s refused (job %s): %s", node_id, kind or "message", job_id or "-", reason
        )
        refused = pb.MessageRejected(kind=kind, job_id=job_id, reason=reason)
        self.connections.send(node_id, pb.ControllerMessage(message_rejected=refused))

    async def _command(self, fn: Callable[..., object], *args: Any) -> None:
        try:
            await asyncio.to_thread(fn, *args)
        except DomainError as e:
            log.info("command %s refused: %s", getattr(fn, "__name__", fn), e)

    async def _on_stream_closed(self, node_id: str, said_goodbye: bool) -> None:
        """The stream is gone: each step runs even when an earlier one failed. An agent that
        said goodbye is offline now: what it sent before (the results of the jobs it drained)
        is handled first, then NODE_STOPPED (after its NODE_STOPPING) lists the jobs it still
        held, lost, and their clients are told. A broken stream leaves the node's jobs waiting
        for it to reconnect (the health sweep takes it offline if it stays silent)."""
        reason = self._goodbyes.pop(node_id, GOODBYE_REASON)
        stopping = self._stopping.pop(node_id, None)
        try:
            self.live.mark_connected(node_id, False, self.clock())
        except Exception:
            log.exception("could not mark node %s disconnected in live state", node_id)
        if self.uplink is not None:
            try:
                await self.uplink.on_node_disconnected(node_id)
                if said_goodbye:
                    await self.uplink.messages_handled()
            except Exception:
                log.exception("job clean-up after node %s disconnected failed", node_id)
        if not said_goodbye:
            log.warning(
                "the control stream of node %s broke; its jobs wait for it to reconnect",
                node_id,
            )
            return
        try:
            if stopping is not None:
                await asyncio.wait({stopping}, timeout=STOPPING_WRITE_TIMEOUT)
            await self._command(self.app.mark_stopped, node_id, reason)
        except Exception:
            log.exception("could not record node %s stopped; the health sweep will", node_id)
        if self.uplink is not None:
            try:
                await self.uplink.on_node_gone(node_id, reason)
            except Exception:
                log.exception("job clean-up after node %s stopped failed", node_id)
