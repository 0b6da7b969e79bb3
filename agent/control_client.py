"""The node agent's control-plane client (``grpc.aio``).

Life of a session (:class:`AgentSession`), logged on every change of the local state:

* ``UNINITIALIZED`` — discover the hardware (:mod:`agent.discovery`) and scan the models dir
  (:mod:`agent.model_store`; hashes are cached, so only new files are hashed).
* ``REGISTERING`` — enroll with the administrator's token unless ``identity.json`` already
  holds a node identity, then open the ``Connect`` stream (metadata ``x-node-id`` /
  ``x-node-credential``) and send ``Hello``.
* ``READY`` — the controller answered ``Welcome``: send a ``ResourceReport``, then a
  ``Heartbeat`` every heartbeat interval, re-send the report when the inventory or the models
  change, and hand every downlink message to the :class:`ControlHandler`.

A lost or unreachable controller sends the session back to ``REGISTERING`` and it retries with
capped exponential backoff and full jitter, printing one line per failed attempt. A refused
enrollment token (:class:`EnrollmentRefused`) and a rejected stored identity
(:class:`IdentityRejected`) are fatal: retrying cannot fix them.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import ipaddress
import logging
import random
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable
from urllib.parse import urlsplit

import grpc
import grpc.aio

from agent import AGENT_VERSION
from agent.discovery import Inventory, discover_inventory, sample_telemetry
from agent.identity import NodeIdentity, identity_path, load_identity, save_identity
from agent.model_store import LocalModel, ModelStore
from proto import MEMORY_LIMIT_LABEL, SLOTS_LABEL
from proto import control_pb2 as pb
from proto import control_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DEFAULT_GRPC_PORT = 50051
DEFAULT_RPC_PORT = 50052
DEFAULT_HEARTBEAT_INTERVAL = 5.0
# Inventory labels the agent sets itself (SLOTS_LABEL, MEMORY_LIMIT_LABEL: see proto).
RESERVED_LABELS = frozenset({SLOTS_LABEL, MEMORY_LIMIT_LABEL})

# The seed's troubleshooting entry for an unreachable control channel.
CONNECTION_HINT = (
    "gRPC connection refused: controller unreachable or control port blocked — verify "
    "controller availability, address, TLS settings and firewall rules"
)

# Enroll answers that retrying cannot fix.
ENROLL_REFUSED_CODES = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)

Send = Callable[[pb.AgentMessage], Awaitable[None]]
"""Queues one AgentMessage for the controller (dropped, with a log line, while disconnected)."""

Jitter = Callable[[float, float], float]

_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class AgentError(Exception):
    """A fatal agent problem; the CLI prints it as one line and exits with code 2."""


class ConfigError(AgentError, ValueError):
    """Bad agent configuration (controller URL, flags, missing token...)."""


class MissingEnrollmentToken(ConfigError):
    """No stored identity and no enrollment token to get one."""


class EnrollmentRefused(AgentError):
    """The controller refused the enrollment token (or the inventory it came with)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"enrollment refused by the controller ({code.name}): {details}")


class IdentityRejected(AgentError):
    """The controller does not accept the stored node identity."""

    def __init__(self, node_id: str, details: str, path: Path) -> None:
        self.node_id = node_id
        self.details = details
        super().__init__(
            f"controller rejected the stored identity of node {node_id} (UNAUTHENTICATED: "
            f"{details}); if this node was removed or the controller reset, delete {path} "
            "and enroll again with a new token"
        )


class _ConnectionLost(Exception):
    """One Enroll/Connect attempt failed or an established stream ended."""

    def __init__(self, reason: str, *, unreachable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unreachable = unreachable


# ---------------------------------------------------------------------------
# Controller URL
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ControllerTarget:
    address: str  # "host:port" as gRPC dials it ("[v6]:port" for IPv6)
    secure: bool
    url: str  # as the operator wrote it, for messages


def parse_controller_url(url: str) -> ControllerTarget:
    """Accept ``host:port``, ``grpc://host:port`` (insecure) and ``grpcs://host:port`` (TLS).

    The port defaults to 50051. Raises :class:`ConfigError` for anything else.
    """
    text = url.strip()
    if not text:
        raise ConfigError("controller URL is empty")
    candidate = text if "://" in text else f"grpc://{text}"
    parts = urlsplit(candidate)
    scheme = parts.scheme.lower()
    if scheme not in ("grpc", "grpcs"):
        raise ConfigError(
            f"unsupported controller URL scheme {parts.scheme!r} in {url!r}; "
            "use host:port, grpc://host:port or grpcs://host:port"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ConfigError(f"controller URL {url!r} must be just scheme://host:port")
    try:
        host = parts.hostname
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid controller URL {url!r}: {exc}") from exc
    if not host:
        raise ConfigError(f"controller URL {url!r} has no host")
    if port is None:
        port = DEFAULT_GRPC_PORT
    if port == 0:
        raise ConfigError(f"controller URL {url!r} has port 0")
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    address = f"[{host}]:{port}" if is_v6 else f"{host}:{port}"
    return ControllerTarget(address=address, secure=scheme == "grpcs", url=text)


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclass
class AgentConfig:
    data_dir: Path
    node_name: str
    controller_url: str | None = None  # None: the URL stored in identity.json
    enrollment_token: str | None = None
    models_dir: Path | None = None  # None: <data_dir>/models
    advertise_address: str = "127.0.0.1"
    rpc_port: int = DEFAULT_RPC_PORT
    labels: dict[str, str] = field(default_factory=dict)
    slots: int = 1
    llama_bin_dir: Path | None = None
    heartbeat_interval: float | None = None  # None: the controller's (Welcome/EnrollResponse)
    tls_ca_file: Path | None = None
    memory_limit_bytes: int | None = None  # None: no limit is reported
    # build_handler() runs llama.cpp only when asked (the CLI does unless --no-runtime).
    llama_runtime: bool = False
    runtime_log_dir: Path | None = None  # None: <data_dir>/logs
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    resource_check_interval: float = 30.0
    rpc_timeout: float = 15.0  # Enroll deadline and how long to wait for Welcome

    @property
    def resolved_models_dir(self) -> Path:
        return self.models_dir if self.models_dir is not None else self.data_dir / "models"

    @property
    def resolved_runtime_log_dir(self) -> Path:
        return self.runtime_log_dir if self.runtime_log_dir is not None else self.data_dir / "logs"

    def inventory_labels(self) -> dict[str, str]:
        labels = {**self.labels, SLOTS_LABEL: str(self.slots)}
        if self.memory_limit_bytes is not None:
            labels[MEMORY_LIMIT_LABEL] = str(self.memory_limit_bytes)
        return labels


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


NO_RUNTIME = "no runtime configured"


def _role_name(role: int) -> str:
    return "worker" if role == pb.ExecutionPlan.WORKER else "primary"


def setup_failure(
    job_id: str, role: str, error: str, error_code: str, failed_node_id: str = ""
) -> pb.AgentMessage:
    """``SetupResult{ok=false}`` for a plan this node cannot run."""
    return pb.AgentMessage(
        setup_result=pb.SetupResult(
            job_id=job_id,
            ok=False,
            error=error,
            error_code=error_code,
            role=role,
            failed_node_id=failed_node_id,
        )
    )


def worker_status(
    job_id: str, state: pb.RpcWorkerStatus.State, host: str, port: int, error: str = ""
) -> pb.AgentMessage:
    """``RpcWorkerStatus`` of this node's RPC worker."""
    return pb.AgentMessage(
        rpc_worker_status=pb.RpcWorkerStatus(
            job_id=job_id, state=state, host=host, port=port, error=error
        )
    )


class NullHandler:
    """A handler without a runtime: refuses every plan and RPC worker."""

    async def on_plan(self, plan: pb.ExecutionPlan, send: Send) -> None:
        log.warning("refusing plan for job %s: %s", plan.job_id, NO_RUNTIME)
        await send(setup_failure(plan.job_id, _role_name(plan.role), NO_RUNTIME, "NO_RUNTIME"))

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


# ---------------------------------------------------------------------------
# Backoff
# ---------------------------------------------------------------------------


class Backoff:
    """Capped exponential backoff with full jitter: attempt n waits
    ``uniform(0, min(maximum, initial * 2**n))``."""

    def __init__(self, initial: float, maximum: float, jitter: Jitter | None = None) -> None:
        if initial <= 0 or maximum < initial:
            raise ConfigError(f"bad backoff: initial={initial}, maximum={maximum}")
        self.initial = initial
        self.maximum = maximum
        self.jitter: Jitter = jitter if jitter is not None else random.uniform
        self.attempt = 0

    def ceiling(self) -> float:
        return min(self.maximum, self.initial * 2.0 ** min(self.attempt, 64))

    def next_delay(self) -> float:
        ceiling = self.ceiling()
        self.attempt += 1
        return max(0.0, min(ceiling, self.jitter(0.0, ceiling)))

    def reset(self) -> None:
        self.attempt = 0


# ---------------------------------------------------------------------------
# Session
# ---------------------------------------------------------------------------


class AgentState(enum.StrEnum):
    UNINITIALIZED = "UNINITIALIZED"
    REGISTERING = "REGISTERING"
    READY = "READY"


@dataclass(eq=False)
class _Connection:
    call: grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControllerMessage]
    queue: asyncio.Queue[pb.AgentMessage] = field(default_factory=asyncio.Queue)


@dataclass(frozen=True)
class _Resources:
    inventory: Inventory
    models: tuple[LocalModel, ...]

    def fingerprint(self) -> tuple[object, ...]:
        """What counts as a meaningful change: everything but free memory and free disk."""
        inv = self.inventory
        gpus = tuple(dataclasses.replace(g, memory_free_bytes=0) for g in inv.gpus)
        stable = dataclasses.replace(inv, disk_free_bytes=0, gpus=gpus, labels={})
        return (stable, tuple(sorted(inv.labels.items())), self.models)

    def to_proto(self) -> pb.ResourceReport:
        return pb.ResourceReport(
            inventory=self.inventory.to_proto(), models=[m.to_proto() for m in self.models]
        )


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
        self._nvml_module = nvml_module
        self._backoff = Backoff(config.backoff_initial, config.backoff_max, jitter)
        self._store = ModelStore(config.resolved_models_dir, config.data_dir)
        self._collect_lock = threading.Lock()
        self._state = AgentState.UNINITIALIZED
        self.state_history: list[AgentState] = [AgentState.UNINITIALIZED]
        self._state_changed = asyncio.Event()
        self.identity: NodeIdentity | None = None
        self.controller_version = ""
        self.heartbeat_interval = config.heartbeat_interval or DEFAULT_HEARTBEAT_INTERVAL
        self.connections = 0  # streams that reached READY
        self.failed_attempts = 0
        self._target: ControllerTarget | None = None
        self._resources: _Resources | None = None
        self._reported: tuple[object, ...] | None = None
        self._conn: _Connection | None = None
        self._channel: grpc.aio.Channel | None = None
        self._dispatch_tasks: set[asyncio.Task[None]] = set()
        self._main_task: asyncio.Task[Any] | None = None
        self._stop_requested = False
        self._closed = False

    # -- state -------------------------------------------------------------------------

    @property
    def state(self) -> AgentState:
        return self._state

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
            self._resources = await self._collect_resources()
            self._log_resources(self._resources)
            self._set_state(AgentState.REGISTERING, "hardware and models discovered")
            identity = await self._ensure_identity()
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
        tasks = list(self._dispatch_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)
        try:
            await self.handler.close()
        except Exception:
            log.exception("handler.close() failed")
        log.info("agent stopped")

    # -- resources --------------------------------------------------------------------

    async def _collect_resources(self) -> _Resources:
        return await asyncio.to_thread(self._collect_resources_sync)

    def _collect_resources_sync(self) -> _Resources:
        # A scan cancelled with its stream keeps running in its thread; never run two at once.
        with self._collect_lock:
            return self._collect_resources_locked()

    def _collect_resources_locked(self) -> _Resources:
        inventory = discover_inventory(
            self.config.data_dir,
            self.config.resolved_models_dir,
            self.config.advertise_address,
            self.config.rpc_port,
            self.config.inventory_labels(),
            nvml_module=self._nvml_module,
        )
        models = tuple(self._store.scan())
        return _Resources(inventory, models)

    @staticmethod
    def _log_resources(resources: _Resources) -> None:
        inv = resources.inventory
        usable = [m.file_name for m in resources.models if m.ok]
        log.info(
            "discovered %s: %s (%d cores / %d threads), %.1f GiB RAM, %d GPU(s), "
            "%d model(s) %s, advertising %s (RPC port %d)",
            inv.hostname,
            inv.cpu_model,
            inv.cpu_cores,
            inv.cpu_threads,
            inv.ram_total_bytes / (1 << 30),
            len(inv.gpus),
            len(usable),
            usable,
            inv.advertised_address,
            inv.rpc_port,
        )
        for model in resources.models:
            if not model.ok:
                log.warning("model %s is unusable: %s", model.path, model.error)

    # -- channel ------------------------------------------------------------------------

    def _resolve_target(self, identity: NodeIdentity | None) -> ControllerTarget:
        url = self.config.controller_url or (identity.controller_url if identity else "")
        if not url:
            raise ConfigError("no controller URL: pass --controller-url or set DACP_CONTROLLER_URL")
        return parse_controller_url(url)

    def _open_channel(self) -> grpc.aio.Channel:
        target = self._target
        assert target is not None
        if target.secure:
            root: bytes | None = None
            if self.config.tls_ca_file is not None:
                try:
                    root = self.config.tls_ca_file.read_bytes()
                except OSError as exc:
                    raise ConfigError(f"cannot read TLS CA file: {exc}") from exc
            credentials = grpc.ssl_channel_credentials(root_certificates=root)
            channel = grpc.aio.secure_channel(target.address, credentials)
        else:
            channel = grpc.aio.insecure_channel(target.address)
        self._channel = channel
        return channel

    async def _close_channel(self, channel: grpc.aio.Channel) -> None:
        if self._channel is channel:
            self._channel = None
        await channel.close(None)

    async def _retry_pause(self, what: str, error: _ConnectionLost) -> None:
        """One line per failed attempt (with the troubleshooting hint), then back off."""
        self.failed_attempts += 1
        delay = self._backoff.next_delay()
        url = self._target.url if self._target else "?"
        log.warning(
            "%s attempt %d failed: %s; retrying in %.2fs — %s (%s)",
            what,
            self._backoff.attempt,
            error.reason,
            delay,
            CONNECTION_HINT,
            url,
        )
        await asyncio.sleep(delay)

    # -- enrollment ---------------------------------------------------------------------

    async def _ensure_identity(self) -> NodeIdentity:
        stored = load_identity(self.config.data_dir)
        self._target = self._resolve_target(stored)
        if stored is not None:
            log.info(
                "using stored identity: node %s (%s), enrolled %s",
                stored.node_id,
                stored.node_name,
                stored.enrolled_at,
            )
            if self.config.enrollment_token:
                log.info("already enrolled; ignoring the enrollment token")
            if stored.controller_url != self._target.url:
                log.warning(
                    "identity was enrolled with controller %s; connecting to %s",
                    stored.controller_url,
                    self._target.url,
                )
            self.identity = stored
            return stored
        if not self.config.enrollment_token:
            raise MissingEnrollmentToken(
                f"no enrollment token and no stored identity in {self.config.data_dir}; "
                "pass --enrollment-token or set DACP_ENROLLMENT_TOKEN"
            )
        identity = await self._enroll(self.config.enrollment_token)
        self.identity = identity
        return identity

    async def _enroll(self, token: str) -> NodeIdentity:
        assert self._target is not None and self._resources is not None
        request = pb.EnrollRequest(
            enrollment_token=token,
            node_name=self.config.node_name,
            agent_version=AGENT_VERSION,
            inventory=self._resources.inventory.to_proto(),
        )
        while True:
            channel = self._open_channel()
            try:
                stub = _stub(channel)
                log.info("enrolling as %r with %s", self.config.node_name, self._target.url)
                response = cast(
                    pb.EnrollResponse,
                    await stub.Enroll(request, timeout=self.config.rpc_timeout),
                )
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() in ENROLL_REFUSED_CODES:
                    raise EnrollmentRefused(exc.code(), exc.details() or "") from None
                failure = _rpc_failure(exc)
            finally:
                await self._close_channel(channel)
            await self._retry_pause("enroll", failure)
        if not response.node_id or not response.node_credential:
            raise AgentError("controller answered Enroll without a node id or credential")
        identity = NodeIdentity.new(
            node_id=response.node_id,
            node_credential=response.node_credential,
            controller_url=self._target.url,
            node_name=self.config.node_name,
        )
        path = save_identity(self.config.data_dir, identity)
        self._backoff.reset()
        if response.heartbeat_interval_seconds > 0 and self.config.heartbeat_interval is None:
            self.heartbeat_interval = response.heartbeat_interval_seconds
        self.controller_version = response.controller_version
        log.info("enrolled as node %s; identity stored in %s", identity.node_id, path)
        return identity

    # -- connect ------------------------------------------------------------------------

    async def _connection_loop(self, identity: NodeIdentity) -> None:
        while True:
            try:
                await self._connect_once(identity)
                failure = _ConnectionLost("control stream ended", unreachable=False)
            except _ConnectionLost as lost:
                failure = lost
            was_ready = self._state == AgentState.READY
            self._set_state(AgentState.REGISTERING, f"control stream lost: {failure.reason}")
            if was_ready:
                self._backoff.reset()
            await self._retry_pause("connect", failure)

    async def _connect_once(self, identity: NodeIdentity) -> None:
        channel = self._open_channel()
        stub = _stub(channel)
        metadata = (
            ("x-node-id", identity.node_id),
            ("x-node-credential", identity.node_credential),
        )
        call = cast(
            grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControllerMessage],
            stub.Connect(metadata=metadata),
        )
        conn = _Connection(call)
        tasks: list[asyncio.Task[None]] = [asyncio.create_task(self._write_loop(conn))]
        try:
            hello = pb.Hello(agent_version=AGENT_VERSION, node_id=identity.node_id)
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
            raise _ConnectionLost("controller closed the stream", unreachable=False)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise IdentityRejected(
                    identity.node_id, exc.details() or "", identity_path(self.config.data_dir)
                ) from None
            raise _rpc_failure(exc) from None
        finally:
            self._conn = None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            call.cancel()
            await self._close_channel(channel)

    async def _await_welcome(self, conn: _Connection, identity: NodeIdentity) -> pb.Welcome:
        try:
            async with asyncio.timeout(self.config.rpc_timeout):
                first = await conn.call.read()
        except TimeoutError:
            raise _ConnectionLost(
                f"no Welcome within {self.config.rpc_timeout:.0f}s", unreachable=False
            ) from None
        if first is _EOF:
            raise await _call_ended(conn.call)
        message = cast(pb.ControllerMessage, first)
        if message.WhichOneof("payload") != "welcome":
            raise _ConnectionLost(
                f"protocol error: expected Welcome, got {message.WhichOneof('payload')}",
                unreachable=False,
            )
        return message.welcome

    async def _on_welcome(
        self, conn: _Connection, identity: NodeIdentity, welcome: pb.Welcome
    ) -> None:
        if welcome.node_id and welcome.node_id != identity.node_id:
            log.warning("Welcome names node %s, expected %s", welcome.node_id, identity.node_id)
        if self.config.heartbeat_interval is not None:
            self.heartbeat_interval = self.config.heartbeat_interval
        elif welcome.heartbeat_interval_seconds > 0:
            self.heartbeat_interval = welcome.heartbeat_interval_seconds
        self.controller_version = welcome.controller_version
        self.connections += 1
        self._backoff.reset()
        assert self._target is not None
        if identity.controller_url != self._target.url:
            self.identity = identity.with_controller_url(self._target.url)
            save_identity(self.config.data_dir, self.identity)
        self._conn = conn
        # The last known resources go out at once; _resource_loop re-checks them right away
        # (hashing a model copied in while disconnected must not delay the heartbeats).
        assert self._resources is not None
        self._queue_report(conn, self._resources)
        self._set_state(
            AgentState.READY,
            f"connected to controller {self._target.url} "
            f"(version {welcome.controller_version or '?'}) as node {identity.node_id}, "
            f"heartbeat every {self.heartbeat_interval:g}s",
        )

    def _queue_report(self, conn: _Connection, resources: _Resources) -> None:
        self._reported = resources.fingerprint()
        conn.queue.put_nowait(pb.AgentMessage(resource_report=resources.to_proto()))

    async def _write_loop(self, conn: _Connection) -> None:
        queue = conn.queue
        while True:
            # Never wait to batch: take what queued up behind the previous write and merge
            # adjacent TokenChunks of one job, so a fast stream costs fewer gRPC writes.
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            for message in merge_token_chunks(batch):
                await self._write(conn, message)

    @staticmethod
    async def _write(conn: _Connection, message: pb.AgentMessage) -> None:
        try:
            await conn.call.write(message)
        except grpc.aio.AioRpcError:
            raise
        except Exception as exc:  # e.g. InvalidStateError: the RPC already finished
            if conn.call.done():
                raise await _call_ended(conn.call) from None
            raise _ConnectionLost(f"write failed: {exc!r}", unreachable=False) from None

    async def _read_loop(self, conn: _Connection) -> None:
        while True:
            received = await conn.call.read()
            if received is _EOF:
                raise await _call_ended(conn.call)
            self._dispatch(cast(pb.ControllerMessage, received))

    async def _heartbeat_loop(self, conn: _Connection) -> None:
        while True:
            telemetry = await asyncio.to_thread(sample_telemetry, nvml_module=self._nvml_module)
            try:
                active = list(self.handler.active_job_ids())
            except Exception:
                log.exception("handler.active_job_ids() failed")
                active = []
            conn.queue.put_nowait(pb.AgentMessage(heartbeat=telemetry.to_proto(active)))
            await asyncio.sleep(self.heartbeat_interval)

    async def _resource_loop(self, conn: _Connection) -> None:
        """Re-check the inventory and models now and then every resource_check_interval;
        send a ResourceReport only when they changed meaningfully."""
        while True:
            resources = await self._collect_resources()
            self._resources = resources
            if resources.fingerprint() != self._reported:
                log.info("inventory or models changed; sending a new ResourceReport")
                self._log_resources(resources)
                self._queue_report(conn, resources)
            await asyncio.sleep(self.config.resource_check_interval)

    # -- downlink -----------------------------------------------------------------------

    async def send(self, message: pb.AgentMessage) -> None:
        """The ``send`` given to the handler: queue ``message`` on the current stream. Never
        blocks or raises; the write loop sends the queue in order (see
        :func:`merge_token_chunks`)."""
        conn = self._conn
        if conn is None:
            log.warning(
                "not connected to the controller; dropping %s", message.WhichOneof("payload")
            )
            return
        conn.queue.put_nowait(message)

    def _dispatch(self, message: pb.ControllerMessage) -> None:
        kind = message.WhichOneof("payload")
        handler = self.handler
        send = self.send
        coro: Coroutine[Any, Any, None]
        if kind == "execution_plan":
            coro = handler.on_plan(message.execution_plan, send)
        elif kind == "start_rpc_worker":
            coro = handler.on_start_rpc_worker(message.start_rpc_worker, send)
        elif kind == "stop_rpc_worker":
            coro = handler.on_stop_rpc_worker(message.stop_rpc_worker, send)
        elif kind == "cancel_job":
            coro = handler.on_cancel(message.cancel_job, send)
        elif kind == "drain":
            log.info("controller requested drain")
            coro = handler.on_drain(send)
        elif kind == "resume":
            log.info("controller requested resume")
            coro = handler.on_resume(send)
        elif kind == "welcome":
            log.debug("ignoring a repeated Welcome")
            return
        else:
            log.warning("ignoring an unknown controller message (newer controller?)")
            return
        task = asyncio.create_task(self._run_handler(kind, message, coro))
        self._dispatch_tasks.add(task)
        task.add_done_callback(self._dispatch_tasks.discard)

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
            await self.send(setup_failure(plan.job_id, _role_name(plan.role), error, "AGENT_ERROR"))
        elif kind == "start_rpc_worker":
            start = message.start_rpc_worker
            await self.send(
                worker_status(
                    start.job_id, pb.RpcWorkerStatus.FAILED, start.host, start.port, error
                )
            )


# Bounds on one merged TokenChunk, far below gRPC's default 4 MiB message limit.
MAX_MERGED_DELTAS = 4096
MAX_MERGED_TEXT = 256 * 1024  # characters (at most 1 MiB of UTF-8)


def merge_token_chunks(messages: Iterable[pb.AgentMessage]) -> list[pb.AgentMessage]:
    """``messages`` in the same order, with each run of adjacent ``TokenChunk`` messages of
    one job merged into one (deltas concatenated in order, up to :data:`MAX_MERGED_DELTAS`
    deltas and :data:`MAX_MERGED_TEXT` characters). Nothing else is merged or reordered; the
    given messages are not modified."""
    merged: list[pb.AgentMessage] = []
    tail: pb.TokenChunk | None = None  # merged[-1]'s chunk while it may still grow
    owned = False  # whether merged[-1] is a copy made here (safe to extend)
    deltas = text = 0
    for message in messages:
        if message.WhichOneof("payload") != "token_chunk":
            merged.append(message)
            tail = None
            continue
        chunk = message.token_chunk
        size = sum(len(delta.text) for delta in chunk.deltas)
        if (
            tail is not None
            and tail.job_id == chunk.job_id
            and deltas + len(chunk.deltas) <= MAX_MERGED_DELTAS
            and text + size <= MAX_MERGED_TEXT
        ):
            if not owned:
                copy = pb.AgentMessage()
                copy.CopyFrom(merged[-1])
                merged[-1] = copy
                tail = copy.token_chunk
                owned = True
            tail.deltas.extend(chunk.deltas)
            deltas += len(chunk.deltas)
            text += size
            continue
        merged.append(message)
        tail, owned, deltas, text = chunk, False, len(chunk.deltas), size
    return merged


def _stub(channel: grpc.aio.Channel) -> Any:
    return pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]


def _rpc_failure(exc: grpc.aio.AioRpcError) -> _ConnectionLost:
    code = exc.code()
    return _ConnectionLost(
        f"{code.name}: {exc.details() or ''}".rstrip(": "),
        unreachable=code == grpc.StatusCode.UNAVAILABLE,
    )


async def _call_ended(
    call: grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ControllerMessage],
) -> Exception:
    """The error describing a finished call (AioRpcError-like status or a clean close)."""
    code = await call.code()
    details = await call.details()
    if code == grpc.StatusCode.OK:
        return _ConnectionLost("controller closed the stream", unreachable=False)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def _install_signal_handlers(session: AgentSession) -> list[signal.Signals]:
    """SIGINT/SIGTERM/SIGHUP stop the session where the loop supports it (not on Windows,
    where Ctrl+C arrives as KeyboardInterrupt and asyncio.run cancels the session instead)."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            loop.add_signal_handler(sig, session.request_stop)
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):
            continue
        installed.append(sig)
    return installed


async def run_agent(
    config: AgentConfig,
    handler: ControlHandler,
    *,
    install_signal_handlers: bool = True,
    jitter: Jitter | None = None,
) -> None:
    """Run one agent session until SIGINT/SIGTERM (or a fatal :class:`AgentError`)."""
    session = AgentSession(config, handler, jitter=jitter)
    installed = _install_signal_handlers(session) if install_signal_handlers else []
    try:
        await session.run()
    finally:
        loop = asyncio.get_running_loop()
        for sig in installed:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
