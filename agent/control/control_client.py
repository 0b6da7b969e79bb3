"""The node agent's control-plane client (``grpc.aio``).

Life of a session (:class:`AgentSession`), logged on every change of the local state:

* ``UNINITIALIZED`` — discover the hardware (:mod:`agent.node.discovery`) and scan the models dir
  (:mod:`agent.models.model_store`; hashes are cached, so only new files are hashed).
* ``REGISTERING`` — enroll with the administrator's token unless ``identity.json`` already
  holds a node identity, then open the ``Connect`` stream (metadata ``x-node-id`` /
  ``x-node-credential``) and send ``Hello``.
* ``READY`` — the controller answered ``Welcome``: send a ``ResourceReport``, then a
  ``Heartbeat`` every heartbeat interval, re-send the report when the inventory or the models
  change, and hand every downlink message to the :class:`ControlHandler`.

Stopping (:meth:`AgentSession.on_signal`, :class:`agent.agent_stop.StopSignals`): the first
SIGINT/SIGTERM/SIGHUP drains the agent.
It tells the controller (``Stopping``: the node takes no new job, and the agent refuses any
plan still on its way), lets its running jobs finish, at most ``drain_timeout``, then says
``Goodbye`` (why: drained, or the drain timed out and the jobs left are lost) and stops. A
second signal stops it at once, its jobs lost; :attr:`AgentSession.exit_code` is then 128 +
the signal's number.

A lost or unreachable controller sends the session back to ``REGISTERING`` and it retries with
capped exponential backoff and full jitter, printing one line per failed attempt. Nothing a job
sent is lost meanwhile: token chunks and results go to the :class:`JobJournal` first, and the
next ``Welcome`` says what the controller still lacks of which jobs; the session re-sends that
and cancels the jobs it leads that the controller gave up on. A refused
enrollment token (:class:`EnrollmentRefused`) and a rejected stored identity
(:class:`IdentityRejected`) are fatal: retrying cannot fix them.

The session holds its parts as fields: :class:`JobTraffic` (``agent/control/job_traffic.py``: job
messages both ways, resuming jobs after a reconnect) and :class:`ControllerChannel`
(``agent/control/controller_channel.py``: channel, retries, enrollment); see also
``agent/node/resources.py`` (what is reported), ``agent/control/control_handler.py``
(the port to what runs jobs), ``agent/control/token_merge.py`` and ``agent/agent_config.py``.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from typing import Any, cast

import grpc
import grpc.aio

from agent import AGENT_VERSION
from agent.agent_config import (
    DEFAULT_HEARTBEAT_INTERVAL,
    AgentConfig,
    IdentityRejected,
    Jitter,
)
from agent.agent_stop import StopSignals
from agent.control.control_handler import (
    ControlHandler,
)
from agent.control.controller_channel import (
    ConnectionLost,
    ControllerChannel,
    rpc_failure,
    stub,
)
from agent.control.job_traffic import Connection, JobTraffic
from agent.control.token_merge import merge_token_chunks
from agent.models.model_transfers import ModelTransfers
from agent.node.identity import NodeIdentity, identity_path, save_identity
from agent.node.resources import ResourceCollector, Resources, log_resources
from wire import control_pb2 as pb

log = logging.getLogger(__name__)


#: How long a stopping agent waits for the controller to hear its goodbye (s).
GOODBYE_TIMEOUT = 2.0

_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs


# ---------------------------------------------------------------------------
# Session
# ---------------------------------------------------------------------------


class AgentState(enum.StrEnum):
    UNINITIALIZED = "UNINITIALIZED"
    REGISTERING = "REGISTERING"
    READY = "READY"


class AgentSession:
    """One agent's relationship with the controller; see the module docstring.

    ``await run()`` returns after :meth:`stop` / :meth:`request_stop` and raises
    :class:`AgentError` subclasses for fatal problems. Either way the channel is closed and
    ``handler.close()`` has been awaited when it returns.
    """

    def __init__(
        self,
        config: AgentConfig,
        handler: ControlHandler,
        *,
        jitter: Jitter | None = None,
        nvml_module: Any | None = None,
    ) -> None:
        self.config = config
        self.handler = handler
        #: The way to the controller: channel, retries, enrollment.
        self.channel = ControllerChannel(config, jitter)
        self._collector = ResourceCollector(config, nvml_module)
        self._state = AgentState.UNINITIALIZED
        self.state_history: list[AgentState] = [AgentState.UNINITIALIZED]
        self._state_changed = asyncio.Event()
        self.identity: NodeIdentity | None = None
        self.controller_version = ""
        self.heartbeat_interval = config.heartbeat_interval or DEFAULT_HEARTBEAT_INTERVAL
        self._resources: Resources | None = None
        self._reported: tuple[object, ...] | None = None
        #: Ask the resource loop to look at the models now (a fetch added one).
        self._recheck = asyncio.Event()
        self.transfers = ModelTransfers(
            config.resolved_models_dir,
            config.data_dir,
            config.advertise_address,
            config.transfer_port,
            on_model_added=self._recheck.set,
            release=getattr(handler, "release_model", None),
            disk_limit=config.models_disk_limit_bytes,
            node_name=config.node_name,
            fetch_limits=config.fetch_limits,
        )
        #: Job messages both ways (the handler's calls, the journal, resuming jobs).
        self.traffic = JobTraffic(handler, self.transfers, lambda: self.draining)
        self._main_task: asyncio.Task[Any] | None = None
        self._stop_requested = False
        self._closed = False
        #: What the stop signals started (a drain), what the Goodbye says, the exit status.
        self.stop_signals = StopSignals(
            config.drain_timeout,
            self._running_jobs,
            self._send_stopping,
            self.request_stop,
            lambda: self._stop_requested,
        )

    # -- state -------------------------------------------------------------------------

    @property
    def state(self) -> AgentState:
        return self._state

    @property
    def connections(self) -> int:
        """Streams that reached READY."""
        return self.channel.connections

    @property
    def failed_attempts(self) -> int:
        return self.channel.failed_attempts

    @property
    def node_id(self) -> str | None:
        return self.identity.node_id if self.identity else None

    def _set_state(self, new: AgentState, reason: str) -> None:
        old = self._state
        if new == old:
            return
        self._state = new
        self.state_history.append(new)
        log.info("agent state %s -> %s: %s", old, new, reason)
        event, self._state_changed = self._state_changed, asyncio.Event()
        event.set()

    async def wait_for_state(self, state: AgentState, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):
            while self._state != state:
                await self._state_changed.wait()

    # -- run / stop ------------------------------------------------------------------

    async def run(self) -> None:
        if self._main_task is not None:
            raise RuntimeError("AgentSession.run() may be called only once")
        self._main_task = asyncio.current_task()
        try:
            if self._stop_requested:
                return
            log.info(
                "agent state %s: node-agent %s discovering hardware and models",
                self._state,
                AGENT_VERSION,
            )
            self._resources = await self._collector.collect()
            log_resources(self._resources)
            self._set_state(AgentState.REGISTERING, "hardware and models discovered")
            identity = await self._ensure_identity(self._resources)
            await self._connection_loop(identity)
        except asyncio.CancelledError:
            if not self._stop_requested:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        finally:
            await self._shutdown()

    def request_stop(self) -> None:
        """Ask a running session to stop (safe from a signal handler); returns at once."""
        if self._stop_requested:
            return
        self._stop_requested = True
        log.info("stopping the agent")
        task = self._main_task
        if (
            task is not None
            and not task.done()
            and not self._closed
            and task is not asyncio.current_task()
        ):
            task.cancel()

    def on_signal(self, signum: int) -> None:
        """A stop signal (safe from a signal handler): the first one drains the session, a
        second one stops it at once (:class:`StopSignals`)."""
        self.stop_signals.on_signal(signum)

    @property
    def draining(self) -> bool:
        """Whether a stop signal drains the agent: plans are refused meanwhile."""
        return self.stop_signals.draining

    @property
    def exit_code(self) -> int:
        return self.stop_signals.exit_code

    def _running_jobs(self) -> list[str]:
        try:
            return list(self.handler.active_job_ids())
        except Exception:
            log.exception("handler.active_job_ids() failed")
            return []

    def _send_stopping(self) -> None:
        """Tells the controller the agent drains (on the current stream, if any; a new
        stream's Welcome sends it again)."""
        conn = self.traffic.conn
        if conn is None or not self.draining:
            return
        stopping = pb.Stopping(
            drain_timeout_seconds=self.config.drain_timeout,
            running_job_ids=self._running_jobs(),
        )
        conn.queue.put_nowait(pb.AgentMessage(stopping=stopping))

    async def stop(self) -> None:
        """Stop: cancel the tasks, close the channel, await ``handler.close()``."""
        self.request_stop()
        task = self._main_task
        if task is None:
            await self._shutdown()
        elif task is not asyncio.current_task() and not task.done():
            await asyncio.wait({task})

    async def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_signals.cancel()
        await self.traffic.cancel()
        await self.channel.close()
        try:
            await self.handler.close()
        except Exception:
            log.exception("handler.close() failed")
        await asyncio.to_thread(self.transfers.close)
        log.info("agent stopped")

    async def _ensure_identity(self, resources: Resources) -> NodeIdentity:
        """The stored identity, or a new one from enrolling (then the controller's version,
        and its heartbeat interval unless the config sets one)."""
        identity, enrolled = await self.channel.ensure_identity(resources)
        self.identity = identity
        if enrolled is not None:
            if enrolled.heartbeat_interval_seconds > 0 and self.config.heartbeat_interval is None:
                self.heartbeat_interval = enrolled.heartbeat_interval_seconds
            self.controller_version = enrolled.controller_version
        return identity

    # -- connect ------------------------------------------------------------------------

    async def _connection_loop(self, identity: NodeIdentity) -> None:
        while True:
            try:
                await self._connect_once(identity)
                failure = ConnectionLost("control stream ended", unreachable=False)
            except ConnectionLost as lost:
                failure = lost
            was_ready = self._state == AgentState.READY
            self._set_state(AgentState.REGISTERING, f"control stream lost: {failure.reason}")
            if was_ready:
                self.channel.reset_backoff()
            await self.channel.retry_pause("connect", failure)

    async def _connect_once(self, identity: NodeIdentity) -> None:
        channel = self.channel.open_channel()
        rpc_stub = stub(channel)
        metadata = (
            ("x-node-id", identity.node_id),
            ("x-node-credential", identity.node_credential),
        )
        call = cast(
            grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControllerMessage],
            rpc_stub.Connect(metadata=metadata),
        )
        conn = Connection(call)
        tasks: list[asyncio.Task[None]] = [asyncio.create_task(self._write_loop(conn))]
        try:
            hello = pb.Hello(
                agent_version=AGENT_VERSION,
                node_id=identity.node_id,
                csr_pem=self.transfers.csr(identity.node_id),
            )
            conn.queue.put_nowait(pb.AgentMessage(hello=hello))
            welcome = await self._await_welcome(conn, identity)
            await self._on_welcome(conn, identity, welcome)
            tasks += [
                asyncio.create_task(self._heartbeat_loop(conn)),
                asyncio.create_task(self._resource_loop(conn)),
                asyncio.create_task(self._read_loop(conn)),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
            raise ConnectionLost("controller closed the stream", unreachable=False)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise IdentityRejected(
                    identity.node_id, exc.details() or "", identity_path(self.config.data_dir)
                ) from None
            raise rpc_failure(exc) from None
        finally:
            self.traffic.conn = None
            if self._stop_requested and len(tasks) == 4:  # writer, heartbeats, report, reader
                await self._say_goodbye(conn, tasks[1:3])
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            call.cancel()
            await self.channel.close_channel(channel)

    async def _await_welcome(self, conn: Connection, identity: NodeIdentity) -> pb.Welcome:
        try:
            async with asyncio.timeout(self._welcome_timeout()):
                first = await conn.call.read()
        except TimeoutError:
            raise ConnectionLost(
                f"no Welcome within {self._welcome_timeout():g}s", unreachable=False
            ) from None
        if first is _EOF:
            raise await _call_ended(conn.call)
        message = cast(pb.ControllerMessage, first)
        if message.WhichOneof("payload") != "welcome":
            raise ConnectionLost(
                f"protocol error: expected Welcome, got {message.WhichOneof('payload')}",
                unreachable=False,
            )
        return message.welcome

    def _welcome_timeout(self) -> float:
        """How long a new stream may stay silent: as long as keepalive lets an open one (a
        TLS handshake into a black hole has no keepalive yet), at most ``rpc_timeout``."""
        config = self.config
        return min(config.rpc_timeout, config.keepalive_interval + config.keepalive_timeout)

    async def _on_welcome(
        self, conn: Connection, identity: NodeIdentity, welcome: pb.Welcome
    ) -> None:
        if welcome.node_id and welcome.node_id != identity.node_id:
            log.warning("Welcome names node %s, expected %s", welcome.node_id, identity.node_id)
        if self.config.heartbeat_interval is not None:
            self.heartbeat_interval = self.config.heartbeat_interval
        elif welcome.heartbeat_interval_seconds > 0:
            self.heartbeat_interval = welcome.heartbeat_interval_seconds
        self.controller_version = welcome.controller_version
        self.channel.connected()
        target = self.channel.target
        if identity.controller_url != target.url:
            self.identity = identity.with_controller_url(target.url)
            save_identity(self.config.data_dir, self.identity)
        self.transfers.controller_host = target.host
        if identity.controller_ca_pem:
            self.transfers.welcomed(
                welcome.node_certificate_pem, identity.controller_ca_pem, welcome.revoked_node_ids
            )
        self.traffic.nodes_revoked(welcome.revoked_node_ids)
        # Before anything else goes out on the new stream: what the controller missed.
        self.traffic.resume_jobs(conn, welcome)
        self.traffic.conn = conn
        self._send_stopping()  # still draining: the node takes no new job over this stream
        # The last known resources go out at once; _resource_loop re-checks them right away
        # (hashing a model copied in while disconnected must not delay the heartbeats).
        assert self._resources is not None
        self._queue_report(conn, self._resources)
        self._set_state(
            AgentState.READY,
            f"connected to controller {target.url} "
            f"(version {welcome.controller_version or '?'}) as node {identity.node_id}, "
            f"heartbeat every {self.heartbeat_interval:g}s",
        )

    async def _say_goodbye(self, conn: Connection, loops: list[asyncio.Task[None]]) -> None:
        """Sends ``Goodbye`` and waits (briefly) for the controller to end the stream: it
        then knows the agent stopped, and takes the node offline at once instead of waiting
        for it to come back. Only the writer touches the call until then: cancelling a task
        that awaits the call cancels the call."""
        for task in loops:  # nothing more is queued after the goodbye
            task.cancel()
        goodbye = pb.AgentMessage(goodbye=pb.Goodbye(reason=self.stop_signals.goodbye_reason))
        conn.queue.put_nowait(goodbye)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(GOODBYE_TIMEOUT):
                await conn.queue.join()  # written
                await conn.call.done_writing()
                await conn.call.code()

    def _queue_report(self, conn: Connection, resources: Resources) -> None:
        self._reported = resources.fingerprint()
        conn.queue.put_nowait(pb.AgentMessage(resource_report=resources.to_proto()))

    async def _write_loop(self, conn: Connection) -> None:
        queue = conn.queue
        while True:
            # Never wait to batch: take what queued up behind the previous write and merge
            # adjacent TokenChunks of one job, so a fast stream costs fewer gRPC writes.
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            for message in merge_token_chunks(batch):
                await self._write(conn, message)
            for _ in batch:
                queue.task_done()

    @staticmethod
    async def _write(conn: Connection, message: pb.AgentMessage) -> None:
        try:
            await conn.call.write(message)
        except grpc.aio.AioRpcError:
            raise
        except Exception as exc:  # e.g. InvalidStateError: the RPC already finished
            if conn.call.done():
                raise await _call_ended(conn.call) from None
            raise ConnectionLost(f"write failed: {exc!r}", unreachable=False) from None

    async def _read_loop(self, conn: Connection) -> None:
        while True:
            received = await conn.call.read()
            if received is _EOF:
                raise await _call_ended(conn.call)
            self.traffic.dispatch(cast(pb.ControllerMessage, received))

    async def _heartbeat_loop(self, conn: Connection) -> None:
        while True:
            telemetry = await asyncio.to_thread(self._collector.telemetry)
            try:
                active = list(self.handler.active_job_ids())
            except Exception:
                log.exception("handler.active_job_ids() failed")
                active = []
            conn.queue.put_nowait(pb.AgentMessage(heartbeat=telemetry.to_proto(active)))
            await asyncio.sleep(self.heartbeat_interval)

    async def _resource_loop(self, conn: Connection) -> None:
        """Re-check the inventory and models now and then every resource_check_interval;
        send a ResourceReport only when they changed meaningfully."""
        while True:
            resources = await self._collector.collect()
            self._resources = resources
            if resources.fingerprint() != self._reported:
                log.info("inventory or models changed; sending a new ResourceReport")
                log_resources(resources)
                self._queue_report(conn, resources)
            self._recheck.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), self.config.resource_check_interval)


async def _call_ended(
    call: grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControllerMessage],
) -> Exception:
    """The error describing a finished call (AioRpcError-like status or a clean close)."""
    code = await call.code()
    details = await call.details()
    if code == grpc.StatusCode.OK:
        return ConnectionLost("controller closed the stream", unreachable=False)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)
