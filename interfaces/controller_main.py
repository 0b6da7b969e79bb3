"""Composition root: builds the controller's parts and serves HTTP and gRPC together."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn

from application.admission import AdmissionQueue
from application.background import BackgroundTasks
from application.context_guard import ContextGuard
from application.enrollment import EnrollmentService
from application.health import HealthMonitor, HealthThresholds
from application.job_manager import JobManager
from application.link_probes import LinkProbes
from application.model_claims import ModelClaims
from application.model_transfers import TransferCoordinator
from application.node_steering import NodeSteering
from application.ports import TicketSigner
from application.prefix_routing import PrefixRouter
from application.runtime_reaper import RuntimeReaper
from application.scheduler import Scheduler, SchedulerConfig
from application.token_recorder import TokenChunkRecorder
from common.contract import AGENT_RECEIVE_BYTES, CONTROLLER_RECEIVE_BYTES
from common.model_file_server import ModelFileServer
from common.transfer_ticket import TICKET_TTL_SECONDS, Ticket, sign_ticket
from domain.node import Node
from domain.states import UNFINISHED_JOB_STATES
from infrastructure.live_state import live_state_for
from infrastructure.model_store import ControllerModelStore
from infrastructure.node_rows import NodeRows, NodeRowsReadModel
from infrastructure.prompt_counter import GgufPromptCounter
from infrastructure.redis_rate_limiter import LimiterCollector, rate_limiter_for
from infrastructure.settings import Settings, SettingsError
from infrastructure.storage import Storage, storage_from_url
from infrastructure.tls import ServerTls, is_loopback, issue_node_cert, load_or_create
from interfaces.controller_shutdown import (
    SignalFreeServer,
    StopSignals,
    drain_controller,
    wait_for_stop,
)
from interfaces.grpc.agent_bridge import JobUplink, ProtoAgentGateway
from interfaces.grpc.grpc_server import (
    MAX_CONCURRENT_RPCS,
    AgentConnections,
    ControlPlaneServicer,
    NodeCertificates,
)
from interfaces.http.admin.event_feed import EventFeed
from interfaces.http.admin.operations_api import (
    cluster_collector,
    install_operations,
    metrics_history,
)
from interfaces.http.http_app import create_app
from interfaces.http.http_peer_log import PeerNamingProtocol
from interfaces.http.http_peer_log import install as install_peer_naming
from interfaces.model_store_server import start_store_server
from interfaces.services import CoreServices, Services
from wire import control_pb2_grpc as pb_grpc
from wire import keepalive

log = logging.getLogger(__name__)

#: How often queued requests re-check for capacity that changed outside this process.
QUEUE_POLL_INTERVAL = 0.5
#: This controller's lease (seconds): renewed every LEASE_RENEW_INTERVAL, it runs out
#: LEASE_TTL after the process dies; then other controllers fail its unfinished jobs (checked
#: every RECONCILE_INTERVAL). Shared through Redis; without it only this process is known.
LEASE_TTL = 10.0
LEASE_RENEW_INTERVAL = 2.0
RECONCILE_INTERVAL = 5.0
#: How often running jobs are checked against their deadlines (seconds).
DEADLINE_CHECK_INTERVAL = 0.5

SWEEP_INTERVAL = 0.5
#: How often the nodes due to measure their links are looked for.
LINK_SWEEP_INTERVAL = 5.0
#: How often idle runtimes are looked for (at most half of RPC_WORKER_IDLE_GRACE and of
#: SERVER_IDLE_GRACE).
REAP_INTERVAL = 5.0


@dataclass
class RunningController:
    services: Services
    storage: Storage
    grpc_server: grpc.aio.Server
    http_server: uvicorn.Server
    grpc_port: int
    http_port: int
    tasks: list[asyncio.Task[Any]]
    #: The running parts that serve no HTTP route, and those its stop and drain end.
    jobs: JobManager
    feed: EventFeed
    recorder: TokenChunkRecorder
    servicer: ControlPlaneServicer
    #: Serves the controller's model store to nodes (None: not served).
    store_server: ModelFileServer | None = None


INSECURE_WARNING = (
    "GRPC_INSECURE=true: the control channel is PLAINTEXT and the HTTP API plain HTTP; "
    "node credentials, API keys, prompts and answers cross the network readable by anyone "
    "on it. Use it only on a network you trust completely."
)


def open_api_check(settings: Settings) -> str | None:
    """Whether /v1 may be served as configured: raises :class:`SettingsError` for an open
    /v1 beyond loopback (no ``AI_API_KEY``) that was not asked for with ``--open-api``
    (``OPEN_API=true``); else the warning to give at every start when /v1 is open (None when
    it wants the key)."""
    if settings.ai_api_key:
        return None
    if is_loopback(settings.host):
        return "AI_API_KEY is not set: /v1 (the inference API) is open to anyone on this machine"
    if not settings.open_api:
        raise SettingsError(
            f"refusing to serve /v1 on {settings.host} (HOST, not loopback) without AI_API_KEY:"
            " anyone who reaches it could use every model and node. Set AI_API_KEY, or start"
            " with --open-api (OPEN_API=true) to serve the inference API to anyone on purpose"
        )
    return (
        f"--open-api (OPEN_API=true) and no AI_API_KEY: /v1, the inference API, is OPEN to anyone"
        f" who can reach {settings.host}:{settings.port}, with every model and node's compute."
        " Set AI_API_KEY unless that network is yours alone"
    )


def controller_tls(settings: Settings) -> ServerTls | None:
    """The controller's TLS material, or None when plaintext was asked for."""
    if settings.insecure:
        return None
    return load_or_create(
        settings.tls_dir,
        cert_file=settings.tls_cert_file,
        key_file=settings.tls_key_file,
        ca_file=settings.tls_ca_file,
    )


def build_services(settings: Settings) -> tuple[CoreServices, Storage]:
    """The parts that exist before anything runs: the store, live state, enrollment."""
    tls = controller_tls(settings)
    storage = storage_from_url(
        settings.database_url,
        var_dir=settings.var_dir,
        pool_size=settings.database_pool_size,
        record_content=settings.record_content,
    ).start()
    services = CoreServices(
        settings=settings,
        app=storage.app,
        read_model=storage.read_model,
        follower=storage.follower,
        live=live_state_for(settings.redis_url, settings.redis_key_prefix),
        limiter=rate_limiter_for(settings.redis_url, settings.redis_key_prefix),
        connections=AgentConnections(),
        enrollment=EnrollmentService(
            storage.app,
            settings.node_enrollment_secret,
            ca_fingerprint=tls.fingerprint if tls is not None else None,
        ),
        context_guard=ContextGuard(
            GgufPromptCounter(ControllerModelStore(settings.model_store_dir))
        ),
        tls=tls,
    )
    return services, storage


async def _deadlines_forever(jobs: JobManager) -> None:
    """Ends jobs past their first-token, idle or request deadline (application/deadlines)."""
    while True:
        await asyncio.sleep(DEADLINE_CHECK_INTERVAL)
        try:
            jobs.enforce_deadlines()
        except Exception:
            log.exception("enforcing job deadlines failed")


async def _prepare_prompt_counts(services: CoreServices) -> None:
    """Reads the tokenizers of the models the store holds, so no first request waits."""
    try:
        models = await asyncio.to_thread(services.read_model.list_models)
        await services.context_guard.prepare([m for m in models if m.get("stored")])
    except Exception:
        log.exception("reading the models' tokenizers ahead failed (read on first use)")


async def _wake_queue_forever(jobs: JobManager) -> None:
    """Local job endings wake the admission queue at once; this catches the rest (a node
    that joined or recovered, a drain lifted, a slot freed by another controller)."""
    while True:
        await asyncio.sleep(QUEUE_POLL_INTERVAL)
        jobs.capacity_changed()


async def _sweep_forever(monitor: HealthMonitor, jobs: JobManager) -> None:
    while True:
        await asyncio.sleep(SWEEP_INTERVAL)
        try:
            actions = await asyncio.to_thread(monitor.sweep, time.time())
            for node_id, action in actions:
                log.info("health: %s %s", action, node_id)
                if action == "offline":  # its jobs waited for it in vain
                    await jobs.node_gone(node_id)
        except Exception:
            log.exception("health sweep failed")


#: Registers the servicer with a gRPC server (the generated function is untyped).
add_servicer: Callable[[ControlPlaneServicer, grpc.aio.Server], None] = (
    pb_grpc.add_ControlPlaneServicer_to_server
)


def ticket_signer(ca_key_pem: bytes | None) -> TicketSigner | None:
    """Transfer tickets signed with the controller's CA key (None without one)."""
    if ca_key_pem is None:
        return None
    key = ca_key_pem

    def sign(sha256: str, node_id: str) -> str:
        return sign_ticket(key, Ticket(sha256, node_id, time.time() + TICKET_TTL_SECONDS))

    return sign


def node_certificates(tls: ServerTls | None) -> NodeCertificates | None:
    """What issues node certificates: the controller's own CA, when it has its key."""
    if tls is None or tls.ca_key_pem is None:
        return None
    ca_pem, ca_key_pem = tls.ca_pem, tls.ca_key_pem
    return lambda node_id, csr: issue_node_cert(ca_pem, ca_key_pem, node_id, csr)


async def _probe_links_forever(links: LinkProbes) -> None:
    """Asks the nodes that are due to measure their links (LinkProbes.sweep decides who)."""
    while True:
        await asyncio.sleep(LINK_SWEEP_INTERVAL)
        try:
            links.sweep(time.time())
        except Exception:
            log.exception("link probes failed")


async def _reap_runtimes_forever(reaper: RuntimeReaper) -> None:
    while True:
        await asyncio.sleep(min(REAP_INTERVAL, reaper.grace / 2, reaper.server_grace / 2))
        try:
            for node_id in await reaper.sweep(time.time()):
                log.info("stopped the idle RPC worker or llama-server of node %s", node_id)
        except Exception:
            log.exception("runtime reaper failed")


async def start_controller(settings: Settings) -> RunningController:
    """Builds every part in dependency order, each given what it needs at construction,
    then serves gRPC and HTTP."""
    open_api = open_api_check(settings)  # before anything is opened or bound
    if open_api is not None:
        log.warning(open_api)
    core, storage = build_services(settings)
    # Node credentials are checked from memory, kept current by the events (first listener:
    # a revocation is known there before any stream is closed for it).
    core.follower.add_event_listener(core.enrollment.on_event)
    loop = asyncio.get_running_loop()
    # Store writes run in the default pool: as many threads as store connections (pool plus
    # overflow, and two for the rest), not the interpreter's default of cores + 4.
    loop.set_default_executor(
        ThreadPoolExecutor(settings.database_pool_size * 2 + 2, thread_name_prefix="store")
    )
    core.connections.bind(loop)
    metrics, feed = install_operations(core, loop)
    # The scheduler and the health sweep read every node often: from memory, not SQL.
    node_views = NodeRowsReadModel(core.read_model, NodeRows(core.read_model).attach(core.follower))
    recorder = TokenChunkRecorder(core.app, settings.token_record_interval)
    recorder.start()
    gateway = ProtoAgentGateway(core.connections)
    steering = NodeSteering(core.app, gateway)
    scheduler = Scheduler(
        node_views,
        core.live,
        SchedulerConfig(settings.allowed_peer_cidrs, min_link_mbps=settings.min_split_link_mbps),
        catch_up=lambda: core.follower.wait(core.app.position(), timeout=5),
        router=PrefixRouter(enabled=settings.prefix_routing),
    )

    def primary_if_held(model: dict[str, Any], nodes: frozenset[str]) -> str | None:
        placed = scheduler.place(model, connected=gateway.is_connected, pretend_holding=nodes)
        return placed.plan.primary.node_id if placed.plan is not None else None

    def replica_if_held(model: dict[str, Any], nodes: frozenset[str]) -> str | None:
        placed = scheduler.place(model, connected=gateway.is_connected, pretend_holding=nodes)
        alone = placed.plan is not None and not placed.plan.workers
        return placed.plan.primary.node_id if placed.plan is not None and alone else None

    def revoked_nodes() -> list[str]:
        return [n["node_id"] for n in node_views.list_nodes() if n.get("revoked")]

    try:
        store_server = start_store_server(settings, core.tls, revoked_nodes())
    except OSError as e:
        storage.close()
        raise OSError(
            f"cannot serve the model store on {settings.grpc_host}:{settings.model_store_port} "
            f"(MODEL_STORE_PORT; off turns it off): {e}"
        ) from e
    # Whatever may free capacity (a model added to a node, a claim proven, a job's end)
    # wakes the queued requests: the admission queue, built before the job manager it feeds.
    queue = AdmissionQueue(settings.queue_max, fair=settings.fair_queueing)
    # Nodes prove the model files they claim before they are planned as their primaries.
    claims = ModelClaims(
        core.app,
        node_views,
        gateway,
        ControllerModelStore(settings.model_store_dir).read_ranges,
        on_proven=queue.wake,
    )
    signer = ticket_signer(core.tls.ca_key_pem if core.tls else None)
    links = LinkProbes(core.app, node_views, gateway, signer, settings.link_probe_interval)
    transfers = TransferCoordinator(
        core.app,
        node_views,
        gateway,
        signer,
        on_model_added=queue.wake,
        primary_if_held=primary_if_held,
        replica_if_held=replica_if_held,
        store_port=store_server.port if store_server is not None else 0,
        source_cidrs=settings.model_source_allowed_cidrs,
        proving=claims.proving,
    )
    jobs = JobManager(
        core.app,
        scheduler,
        gateway,
        recorder,
        worker_timeout=settings.rpc_worker_timeout,
        setup_timeout=settings.setup_timeout,
        metrics=metrics,
        queue=queue,
        queue_timeout=settings.queue_timeout,
        deadlines=settings.deadlines(),
        fetcher=transfers,
    )
    servicer = ControlPlaneServicer(
        app=core.app,
        enrollment=core.enrollment,
        live=core.live,
        connections=core.connections,
        heartbeat_interval=settings.heartbeat_interval,
        uplink=JobUplink(jobs, transfers, claims, links),
        allowed_cidrs=settings.allowed_peer_cidrs,
        allow_nat=settings.enroll_allow_nat,
        node_certificates=node_certificates(core.tls),
        revoked_nodes=revoked_nodes,
    )
    metrics.add_collector(cluster_collector(core, jobs, feed, servicer, metrics))
    if core.limiter is not None:
        metrics.add_collector(LimiterCollector(core.limiter))
    history = metrics_history(core, jobs, node_views.list_nodes, metrics)
    core.follower.add_event_listener(claims.listener)
    core.follower.add_event_listener(_revocations(steering, jobs, loop, store_server))
    core.app.owner = str(uuid.uuid4())
    await asyncio.to_thread(core.live.renew_lease, core.app.owner, LEASE_TTL)
    orphans = await jobs.fail_orphans(lambda: asyncio.to_thread(_orphaned_jobs, core))
    if orphans:
        log.warning("failed %d job(s) whose controller is gone", orphans)
    grpc_server = grpc.aio.server(
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        options=[
            *keepalive.server_options(settings.keepalive_interval, settings.keepalive_timeout),
            ("grpc.max_receive_message_length", CONTROLLER_RECEIVE_BYTES),
            ("grpc.max_send_message_length", AGENT_RECEIVE_BYTES),
            ("grpc.http2.bdp_probe", 0),
        ],
    )
    add_servicer(servicer, grpc_server)
    address = f"{settings.grpc_host}:{settings.grpc_port}"
    if core.tls is not None:
        credentials = grpc.ssl_server_credentials([(core.tls.key_pem, core.tls.chain_pem)])
        grpc_port = grpc_server.add_secure_port(address, credentials)
    else:
        log.warning(INSECURE_WARNING)
        grpc_port = grpc_server.add_insecure_port(address)
    if grpc_port == 0:
        if store_server is not None:
            store_server.stop()
        storage.close()
        raise OSError(f"cannot bind the gRPC port {settings.grpc_host}:{settings.grpc_port}")
    await grpc_server.start()
    services = Services.running(
        core,
        jobs=jobs,
        transfers=transfers,
        claims=claims,
        metrics=metrics,
        feed=feed,
        history=history,
        steering=steering,
        grpc_port=grpc_port,  # the port bound (GRPC_PORT=0: a free one)
        model_rows=node_views,
    )

    http_app = create_app(services)
    https = https_files(settings, services.tls)
    config = uvicorn.Config(
        http_app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        lifespan="on",
        ssl_certfile=https[0] if https else None,
        ssl_keyfile=https[1] if https else None,
        http=PeerNamingProtocol,  # a bad request's warning names its source
    )
    install_peer_naming()
    http_server = SignalFreeServer(config)
    monitor = HealthMonitor(
        services.app,
        node_views,
        services.live,
        HealthThresholds(settings.degraded_after, settings.offline_after),
        started_at=time.time(),
    )
    reaper = RuntimeReaper(
        services.app,
        node_views,
        gateway,
        settings.rpc_worker_idle_grace,
        settings.server_idle_grace,
        forget=scheduler.router.forget,
    )
    tasks = [
        asyncio.create_task(http_server.serve(), name="http"),
        asyncio.create_task(_sweep_forever(monitor, jobs), name="health-sweep"),
        asyncio.create_task(_reap_runtimes_forever(reaper), name="runtime-reaper"),
        asyncio.create_task(_probe_links_forever(links), name="link-probes"),
        asyncio.create_task(_wake_queue_forever(jobs), name="queue-waker"),
        asyncio.create_task(_deadlines_forever(jobs), name="deadlines"),
        asyncio.create_task(_lease_forever(services, jobs), name="lease"),
        asyncio.create_task(claims.run(), name="model-claims"),
        asyncio.create_task(history.run(), name="metrics-history"),
        asyncio.create_task(_prepare_prompt_counts(services), name="prompt-counts"),
    ]
    while not http_server.started:
        if tasks[0].done():
            await grpc_server.stop(None)
            if store_server is not None:
                store_server.stop()
            storage.close()
            tasks[0].result()
            raise OSError(f"cannot bind the HTTP port {settings.host}:{settings.port}")
        await asyncio.sleep(0.02)
    http_port = http_server.servers[0].sockets[0].getsockname()[1]
    return RunningController(
        services,
        storage,
        grpc_server,
        http_server,
        grpc_port,
        http_port,
        tasks,
        jobs=jobs,
        feed=feed,
        recorder=recorder,
        servicer=servicer,
        store_server=store_server,
    )


def _revocations(
    steering: NodeSteering,
    jobs: JobManager,
    loop: asyncio.AbstractEventLoop,
    store_server: ModelFileServer | None,
) -> Callable[[int, object], None]:
    """A follower listener: whoever recorded NODE_REVOKED (this controller's admin API,
    another controller, `dacp nodes revoke`), the node's stream here is closed, the clients
    of its jobs are told, and the model file servers (every connected node's, and the
    store's) refuse it from now on, whatever ticket it still holds."""
    background = BackgroundTasks("handling a revoked node")

    def revoked(node_id: str) -> None:
        if steering.revoked(node_id):
            log.warning("node %s was revoked: its control stream is closed", node_id)
        if store_server is not None:
            store_server.revoke([node_id])
        background.spawn(jobs.node_gone(node_id))

    def listener(_position: int, event: object) -> None:
        if isinstance(event, Node.Revoked):
            loop.call_soon_threadsafe(revoked, str(event.originator_id))

    return listener


def _orphaned_jobs(services: CoreServices) -> list[str]:
    """Unfinished jobs whose controller is gone: not this one, and its lease has run out
    (or the job predates leases). Raises when the leases cannot be read (Redis down), so
    that no live controller's job is failed on a guess."""
    services.app.guard.check()  # store unreachable: nothing to decide now
    services.follower.wait(services.app.position(), timeout=30)
    live = services.live.live_owners() | {services.app.owner}
    return [
        row["job_id"]
        for state in sorted(UNFINISHED_JOB_STATES)
        for row in services.read_model.list_jobs(state=state, limit=10_000)
        if row.get("controller", "") not in live
    ]


def _own_unfinished_jobs(services: CoreServices) -> list[str]:
    """This controller's own unfinished jobs, as the store shows them (reconciliation ends
    those no run here holds any more: :meth:`JobManager.end_stale_jobs`)."""
    services.app.guard.check()  # store unreachable: nothing to decide now
    owner = services.app.owner
    return [
        row["job_id"]
        for state in sorted(UNFINISHED_JOB_STATES)
        for row in services.read_model.list_jobs(state=state, limit=10_000)
        if row.get("controller", "") == owner
    ]


async def _lease_forever(services: CoreServices, jobs: JobManager) -> None:
    """Keeps this controller's lease alive, fails the jobs of controllers that died (their
    lease ran out): their clients are gone and their node slots must come free; and ends this
    controller's own jobs whose ending was lost."""
    last_reconcile = time.monotonic()
    while True:
        await asyncio.sleep(LEASE_RENEW_INTERVAL)
        due = time.monotonic() - last_reconcile >= RECONCILE_INTERVAL
        if due:
            last_reconcile = time.monotonic()
        try:
            await asyncio.to_thread(services.live.renew_lease, services.app.owner, LEASE_TTL)
            if due:
                failed = await jobs.fail_orphans(
                    lambda: asyncio.to_thread(_orphaned_jobs, services)
                )
                if failed:
                    log.warning("failed %d job(s) whose controller is gone", failed)
        except Exception as e:
            log.warning("controller lease or reconciliation skipped: %r", e)
        if due:
            try:  # needs the store only, not the leases
                ended = await jobs.end_stale_jobs(
                    lambda: asyncio.to_thread(_own_unfinished_jobs, services)
                )
                if ended:
                    log.warning("ended %d job(s) of this controller left unfinished", len(ended))
            except Exception as e:
                log.warning("reconciling this controller's own jobs skipped: %r", e)


#: How long a stopping controller waits for its background tasks once they are cancelled
#: (and the HTTP server once told to exit).
STOP_TASKS_TIMEOUT = 10.0


async def stop_controller(running: RunningController) -> None:
    running.feed.close()  # open SSE streams end, or uvicorn would wait for them forever
    running.http_server.should_exit = True
    await running.grpc_server.stop(grace=1.0)
    if running.store_server is not None:
        await asyncio.to_thread(running.store_server.stop)
    await running.recorder.stop()
    for task in running.tasks:
        if task.get_name() != "http":
            task.cancel()
    _, stuck = await asyncio.wait(running.tasks, timeout=STOP_TASKS_TIMEOUT)
    for task in stuck:
        # A stop is bounded: a task that ignores its cancellation is named (with where it
        # waits) and left behind, rather than holding the controller's exit forever.
        where = io.StringIO()
        task.print_stack(file=where)
        log.warning(
            "task %s did not stop within %g s; leaving it: %s",
            task.get_name(),
            STOP_TASKS_TIMEOUT,
            where.getvalue(),
        )
        task.cancel()
    for task in running.tasks:
        if task.done() and not task.cancelled():
            with contextlib.suppress(Exception):
                task.result()
    # A clean stop gives up the lease at once: a controller started next (or another one
    # sharing the store) fails this one's unfinished jobs without waiting for it to run out.
    with contextlib.suppress(Exception):
        await asyncio.to_thread(running.services.live.renew_lease, running.services.app.owner, 0)
    running.services.live.close()
    if running.services.limiter is not None:
        await running.services.limiter.close()
    running.storage.close()


@contextlib.asynccontextmanager
async def controller(settings: Settings) -> AsyncIterator[RunningController]:
    running = await start_controller(settings)
    try:
        yield running
    finally:
        await stop_controller(running)


def https_files(settings: Settings, tls: ServerTls | None) -> tuple[str, str] | None:
    """The certificate chain and key files the HTTP API is served with: HTTPS whenever it
    listens beyond loopback (and TLS is on); plain HTTP on loopback, where the traffic never
    leaves the machine."""
    if tls is None or is_loopback(settings.host):
        return None
    return str(tls.chain_file), str(tls.key_file)


async def serve_forever(
    settings: Settings, on_up: Callable[[RunningController], None] | None = None
) -> None:
    """Runs a controller until SIGTERM or SIGINT; ``on_up`` is called once it serves."""
    if not settings.admin_api_key:
        log.warning("ADMIN_API_KEY is not set: the admin API and dashboard are disabled")
    async with controller(settings) as running:
        tls = running.services.tls
        log.warning(
            "controller up: HTTP on %s://%s:%d, gRPC%s on %s:%d, store %s",
            "https" if https_files(settings, tls) else "http",
            settings.host,
            running.http_port,
            f" over TLS (CA sha256 {tls.fingerprint})" if tls else " in PLAINTEXT",
            settings.grpc_host,
            running.grpc_port,
            "postgres" if running.services.follower.uses_subscription else "sqlite",
        )
        if tls is None:
            log.warning(INSECURE_WARNING)
        if on_up is not None:
            on_up(running)
        signals = StopSignals()
        signals.install()
        try:
            await wait_for_stop(running, signals)
            if signals.requested.is_set():
                await drain_controller(running, settings.shutdown_timeout, signals)
        finally:
            signals.remove()
        if running.tasks[0].done() and not running.tasks[0].cancelled():
            running.tasks[0].result()  # the HTTP server's own failure, if any
