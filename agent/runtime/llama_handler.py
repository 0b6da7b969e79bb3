"""The agent's :class:`~agent.control.control_client.ControlHandler` backed by llama.cpp.

Downlink messages and what this handler does with them:

* ``StartRpcWorker{host, port, peers}`` — make sure the node's single
  ``ggml-rpc-server`` runs on exactly ``host:port`` and lets in exactly ``peers`` (its
  accept filter, ``agent/runtime/rpc_filter.py``, or where that cannot load the copying guard,
  ``agent/runtime/rpc_guard.py``; see ``agent/runtime/rpc_host.py``; reused when already alive
  there; a dead one or one on another address is replaced) and answer
  ``RpcWorkerStatus`` ``STARTED`` or ``FAILED`` with the reason (a wildcard or public bind
  address is refused). The set replaces the one before, and a connection still open from an
  address it leaves out is closed. The worker keeps running across jobs so a warm
  ``llama-server`` on a primary keeps its connection. ``RpcWorkerPeers`` (a job using it
  ended) replaces the set without touching open connections; ``NodesRevoked`` takes the
  revoked nodes' addresses out and closes their connections at once. ``StopRpcWorker`` stops
  it (``STOPPED``).
* ``ExecutionPlan`` with role ``PRIMARY`` — setup and validation, answered by one
  ``SetupResult``: the model file is looked up by name in the models dir (``MODEL_NOT_FOUND``),
  its sha256 checked against the plan through the model store's hash cache
  (``SHA256_MISMATCH``), every RPC peer probed with a TCP connect (``RPC_PEER_UNREACHABLE``
  with ``failed_node_id``), then the ``llama-server`` the plan asks for
  (:func:`agent.runtime.server_spec.server_spec_for`: model, context, slots, peers, devices and
  shares) is reused when warm or (re)started (``RUNTIME_START_FAILED`` with the key stderr
  line; ``out_of_memory`` with the device, its node and the bytes it asked for when llama.cpp
  ran out: :mod:`agent.runtime.out_of_memory`). Every slot keeps the plan's whole context
  (``--ctx-size`` = context * slots; at most this node's ``slots``, else ``INVALID_PLAN``).
  A server busy with another job's different spec for longer than ``busy_timeout`` is
  ``RUNTIME_BUSY``. Then the chat completion streams from the local ``llama-server``: each
  content piece becomes a ``Delta`` (``seq`` from 0, no gaps, ``tokens=1``) sent at once in
  its own ``TokenChunk``, and a ``JobResult`` closes the job (usage and timings from
  llama-server, measured here when it sends none). A crash or HTTP failure during generation
  is ``JobResult{ok=false, phase="execution"}`` with ``RUNTIME_CRASHED``,
  ``GENERATION_FAILED`` or ``out_of_memory``.
* ``ExecutionPlan`` with role ``WORKER`` — nothing to do beyond the RPC worker that
  ``StartRpcWorker`` already started: logged, no reply (the controller expects setup results
  from primaries only).
* ``CancelJob`` — cancels the job's task; closing the HTTP stream makes llama-server stop
  generating. Answered by ``JobResult{ok=false, finish_reason="cancelled",
  error_code="CANCELLED"}`` with ``phase`` "setup" or "execution".

A ``llama-server`` or ``ggml-rpc-server`` that exits unexpectedly is reported at once as
``RuntimeFault{fatal=false}`` (a llama-server crash during a generation is reported by that
job's ``JobResult`` instead). :meth:`LlamaHandler.close` stops every child process.

Agent code: imports only the standard library, third-party packages, ``proto`` and ``agent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import psutil

from agent.agent_config import DEFAULT_SLOTS
from agent.control.control_handler import Send, job_failure, setup_failure
from agent.runtime.embeddings_job import embeddings_result
from agent.runtime.endpoints import peer_endpoint
from agent.runtime.job_messages import (
    AGENT_STOPPING,
    CANCELLED,
    GENERATION_FAILED,
    INVALID_PLAN,
    JOB_ALREADY_RUNNING,
    RUNTIME_BUSY,
    RUNTIME_START_FAILED,
    TOKEN_BATCH_SECONDS,
    DeltaSender,
    SetupFailure,
    failure_of,
    generation_stats,
    job_request,
)
from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.llama_server import (
    ChatRequest,
    EmbeddingsRequest,
    LlamaServer,
)
from agent.runtime.managed_child import ProcessExit
from agent.runtime.out_of_memory import Blame, PlanDevices, oom_message, out_of_memory, plan_devices
from agent.runtime.plan_model import PlanModels
from agent.runtime.rpc_guard import RpcGuard
from agent.runtime.rpc_host import RpcWorkerHost
from agent.runtime.rpc_peers import probe_peers, warm_links
from agent.runtime.rpc_worker import RpcWorker
from agent.runtime.runtime import RuntimeManager
from agent.runtime.runtime_errors import LlamaRuntimeError
from agent.runtime.server_spec import DEFAULT_POLL, ServerSpec, prompt_cache_mib, server_spec_for
from common.contract import DEFAULT_ALLOWED_PEER_CIDRS, DEFAULT_RPC_PORT, OUT_OF_MEMORY
from wire import control_pb2 as pb

log = logging.getLogger(__name__)

_BUSY_POLL_SECONDS = 0.05
_FINISHED = "finished"  # _Job.phase once its final message is being sent

# ---------------------------------------------------------------------------
# Handler
# ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    job_id: str
    task: asyncio.Task[None] | None = None
    phase: str = "setup"
    cancel_requested: bool = False
    cancel_reason: str = ""
    #: The plan's devices as this primary's llama-server names them (out-of-memory blame).
    devices: PlanDevices | None = None


class LlamaHandler:
    """Runs the controller's jobs on this node's llama.cpp processes; see the module doc."""

    def __init__(
        self,
        binaries: RuntimeBinaries,
        *,
        models_dir: Path | str,
        data_dir: Path | str,
        log_dir: Path | str,
        slots: int = DEFAULT_SLOTS,
        rpc_port: int = DEFAULT_RPC_PORT,
        rpc_threads: int | None = None,
        server_threads: int | None = None,
        server_poll: int = DEFAULT_POLL,
        memory_limit_bytes: int | None = None,
        stream_interval: float = TOKEN_BATCH_SECONDS,
        allow_public_rpc: bool = False,
        allowed_peer_cidrs: Sequence[str] = DEFAULT_ALLOWED_PEER_CIDRS,
        probe_timeout: float = 2.0,
        start_timeout: float = 180.0,
        busy_timeout: float = 30.0,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.binaries = binaries
        self.models_dir = Path(models_dir)
        self.data_dir = Path(data_dir)
        self.log_dir = Path(log_dir)
        self.slots = slots
        self.server_threads = server_threads
        self.server_poll = server_poll
        #: The node's --memory-limit: what it offers, of which a server's prompt cache is sized.
        self.memory_limit_bytes = memory_limit_bytes
        #: The shortest time between two messages of a job's tokens (:class:`DeltaSender`).
        self.stream_interval = stream_interval
        self.probe_timeout = probe_timeout
        self.busy_timeout = busy_timeout
        self.runtime = RuntimeManager(
            binaries, self.log_dir, on_exit=self._on_child_exit, start_timeout=start_timeout
        )
        self._jobs: dict[str, _Job] = {}
        #: This node's RPC worker and who may reach it (:mod:`agent.runtime.rpc_host`).
        self.rpc_host = RpcWorkerHost(
            self.runtime,
            self.data_dir,
            rpc_port=rpc_port,
            rpc_threads=rpc_threads,
            allow_public_rpc=allow_public_rpc,
            allowed_peer_cidrs=tuple(allowed_peer_cidrs),
            attach=self._attach,
            closing=lambda: self._closed,
        )
        # Jobs holding the llama-server (from setup until their generation ends) and its spec.
        self._server_users = 0
        self._server_spec: ServerSpec | None = None
        # The stop of a retired idle server under way (StopServer), which setups wait for.
        self._stopping: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send: Send | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        # One keep-alive HTTP client for the embeddings requests to llama-server (a new client
        # per request cost several milliseconds). Generations stream over a connection each
        # (agent/runtime/llama_stream.py).
        self._http: httpx.AsyncClient | None = None
        self.models = PlanModels(self.models_dir, self.data_dir)

    # -- ControlHandler ---------------------------------------------------------------

    def active_job_ids(self) -> list[str]:
        return list(self._jobs)

    async def on_plan(self, plan: pb.ExecutionPlan, send: Send) -> None:
        self._attach(send)
        if plan.role == pb.ExecutionPlan.WORKER:
            log.info("job %s: worker role; the RPC worker is all it needs", plan.job_id)
            return
        if self._closed or plan.job_id in self._jobs:
            code, error = (
                (AGENT_STOPPING, "agent is stopping")
                if self._closed
                else (JOB_ALREADY_RUNNING, f"job {plan.job_id} is already running here")
            )
            await send(setup_failure(plan.job_id, "primary", error, code))
            return
        job = _Job(plan.job_id)
        self._jobs[job.job_id] = job
        job.task = asyncio.create_task(self._run_primary(job, plan, send))
        try:
            await job.task
        finally:
            if self._jobs.get(job.job_id) is job:
                del self._jobs[job.job_id]

    async def on_cancel(self, msg: pb.CancelJob, send: Send) -> None:
        self._attach(send)
        job = self._jobs.get(msg.job_id)
        if job is None or job.task is None or job.task.done() or job.phase == _FINISHED:
            log.info("cancel for job %s: not running here", msg.job_id)
            return
        log.info("cancelling job %s (%s) during %s", msg.job_id, msg.reason or "-", job.phase)
        job.cancel_requested = True
        job.cancel_reason = msg.reason
        job.task.cancel()

    async def on_drain(self, send: Send) -> None:
        self._attach(send)
        log.info("drain requested; %d job(s) running", len(self._jobs))

    async def on_resume(self, send: Send) -> None:
        self._attach(send)
        log.info("resume requested")

    async def close(self) -> None:
        """Cancel every job and stop every child process. Idempotent."""
        self._closed = True
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for background in list(self._background):
            background.cancel()
        await self.rpc_host.close()
        await asyncio.to_thread(self.runtime.close)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # -- the RPC worker (agent/runtime/rpc_host.py) ------------------------------------------------

    async def on_start_rpc_worker(self, msg: pb.StartRpcWorker, send: Send) -> None:
        await self.rpc_host.on_start_rpc_worker(msg, send)

    async def on_rpc_worker_peers(self, msg: pb.RpcWorkerPeers, send: Send) -> None:
        await self.rpc_host.on_rpc_worker_peers(msg, send)

    async def on_nodes_revoked(self, node_ids: Sequence[str]) -> None:
        await self.rpc_host.on_nodes_revoked(node_ids)

    async def on_stop_rpc_worker(self, msg: pb.StopRpcWorker, send: Send) -> None:
        await self.rpc_host.on_stop_rpc_worker(msg, send)

    @property
    def rpc_worker(self) -> RpcWorker | None:
        """The running ``ggml-rpc-server``, if any."""
        return self.rpc_host.rpc_worker

    # -- primary: setup ------------------------------------------------------------------

    async def _run_primary(self, job: _Job, plan: pb.ExecutionPlan, send: Send) -> None:
        job.devices = plan_devices(plan)
        try:
            try:
                server, request = await self._setup(plan)
            except SetupFailure as failure:
                log.warning(
                    "job %s: setup failed (%s): %s", job.job_id, failure.error_code, failure
                )
                job.phase = _FINISHED
                await send(
                    setup_failure(
                        job.job_id,
                        "primary",
                        failure.message,
                        failure.error_code,
                        failure.failed_node_id,
                        failed_device=failure.failed_device,
                        failed_bytes=failure.failed_bytes,
                    )
                )
                return
            try:
                await send(
                    pb.AgentMessage(
                        setup_result=pb.SetupResult(job_id=job.job_id, ok=True, role="primary")
                    )
                )
                job.phase = "execution"
                if isinstance(request, EmbeddingsRequest):
                    await self._embed(job, server, request, send)
                else:
                    await self._execute(job, server, request, send)
            except Exception as exc:
                # A fault of the agent's own after the setup result: the job fails now, as a
                # failed result (the agent's catch-all would answer with a setup failure, which
                # the controller can only take as a late one: application/job_relay.py).
                if job.phase == _FINISHED:
                    raise
                log.exception("job %s: the agent failed during %s", job.job_id, job.phase)
                job.phase = _FINISHED
                message = f"agent handler failed: {type(exc).__name__}: {exc}"
                await send(job_failure(job.job_id, "execution", GENERATION_FAILED, message))
            finally:
                self._release_server()
        except asyncio.CancelledError:
            if not job.cancel_requested:
                raise  # the agent is stopping
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            log.info("job %s cancelled during %s", job.job_id, job.phase)
            await send(
                job_failure(
                    job.job_id,
                    job.phase,
                    CANCELLED,
                    f"cancelled: {job.cancel_reason}" if job.cancel_reason else "cancelled",
                    finish_reason="cancelled",
                )
            )

    async def _setup(
        self, plan: pb.ExecutionPlan
    ) -> tuple[LlamaServer, ChatRequest | EmbeddingsRequest]:
        """Validate the plan and return a healthy llama-server (reserved: call
        :meth:`_release_server` afterwards) and what the job asks it for."""
        request = job_request(plan)
        model_path = await self.models.resolve(plan.model_file_name, plan.model_sha256)
        try:
            spec = server_spec_for(
                plan, model_path, self.slots, self.server_threads, self.server_poll
            )
        except ValueError as exc:
            raise SetupFailure(INVALID_PLAN, str(exc)) from None
        await self._reserve_server(spec)
        if self._stopping is not None:  # a retired server is going: start afresh after it
            await asyncio.shield(self._stopping)
        if not spec.rpc_endpoints:
            # A warm one-node server is used as it is: no thread hop, nothing to probe.
            warm = self.runtime.running_server(spec)
            if warm is not None:
                return warm, request
        try:
            linked, restart = await asyncio.to_thread(warm_links, self.runtime.server, spec)
            await probe_peers(
                [p for p in plan.rpc_peers if peer_endpoint(p) not in linked],
                self.probe_timeout,
            )
            try:
                server = await asyncio.to_thread(self._ensure_server, spec, restart, plan)
            except LlamaRuntimeError as exc:
                oom = out_of_memory(exc, plan_devices(plan))
                if oom is None:
                    raise SetupFailure(RUNTIME_START_FAILED, str(exc)) from None
                blame, line = oom
                raise SetupFailure(
                    OUT_OF_MEMORY,
                    oom_message(blame, line, exc),
                    failed_node_id=blame.node_id,
                    failed_device=blame.device,
                    failed_bytes=blame.bytes,
                ) from None
        except BaseException:
            self._release_server()
            raise
        return server, request

    async def _reserve_server(self, spec: ServerSpec) -> None:
        """Wait until no running job needs a llama-server with a different spec."""
        deadline = time.monotonic() + self.busy_timeout
        while self._server_users > 0 and self._server_spec != spec:
            if time.monotonic() >= deadline:
                raise SetupFailure(
                    RUNTIME_BUSY,
                    f"llama-server is busy with {self._server_users} job(s) using another "
                    f"model, context or split for more than {self.busy_timeout:g}s",
                )
            await asyncio.sleep(_BUSY_POLL_SECONDS)
        self._server_users += 1
        self._server_spec = spec

    async def on_stop_server(self, msg: pb.StopServer) -> None:
        """The controller retired this node's idle runtime: stop its llama-server and free its
        memory, unless a job uses it (set up after the retirement: that job's plan starts
        the server it needs)."""
        if self.runtime.server is None:
            return
        if self._server_users > 0:
            log.info("keeping llama-server (%s): %d job(s) use it", msg.reason, self._server_users)
            return
        log.info("stopping the idle llama-server: %s", msg.reason or "retired")
        stopping = asyncio.ensure_future(asyncio.to_thread(self.runtime.stop_server))
        self._stopping = stopping
        try:
            await stopping
        finally:
            if self._stopping is stopping:
                self._stopping = None

    async def release_model(self, path: Path) -> bool:
        """Lets the model file at ``path`` go: stops the llama-server that has it loaded when
        no job uses that server; False while one does."""
        server = self.runtime.server
        if server is None or Path(server.spec.model_path) != path.resolve():
            return True
        if self._server_users > 0:
            return False
        await asyncio.to_thread(self.runtime.stop_server)
        return True

    def _release_server(self) -> None:
        self._server_users = max(0, self._server_users - 1)

    def _ensure_server(
        self, spec: ServerSpec, restart: bool, plan: pb.ExecutionPlan | None = None
    ) -> LlamaServer:
        if restart:
            current = self.runtime.server
            if current is not None and current.spec == spec:
                self.runtime.stop_server()
        if plan is not None:
            # A server started now gets a prompt cache its node has room for (a running one
            # with an equal spec is reused as it is); while another still runs, what is free
            # is counted without what it would give back, so the cache errs small.
            spec = replace(spec, cache_ram_mib=prompt_cache_mib(plan, self._free_host_bytes()))
        return self.runtime.ensure_server(spec)

    def _free_host_bytes(self) -> int:
        """Host memory free for a server now: what the system has available, within the
        node's --memory-limit."""
        available = int(psutil.virtual_memory().available)
        limit = self.memory_limit_bytes
        return available if limit is None else min(available, limit)

    # -- primary: execution --------------------------------------------------------------

    async def _execute(
        self, job: _Job, server: LlamaServer, request: ChatRequest, send: Send
    ) -> None:
        sender = DeltaSender(job.job_id, send, self.stream_interval)
        started = time.monotonic()
        first_piece: float | None = None
        last_piece: float | None = None
        finish_reason: str | None = None
        usage = None
        timings = None
        failure: tuple[str, str] | None = None
        blame: Blame | None = None
        stream = server.stream_chat(request)
        try:
            async for delta in stream:
                if delta.text or delta.extra:
                    last_piece = time.monotonic()
                    first_piece = first_piece or last_piece
                    await sender.push(delta.text, extra=delta.extra)
                finish_reason = delta.finish_reason or finish_reason
                usage = delta.usage or usage
                timings = delta.timings or timings
        except LlamaRuntimeError as exc:
            failure = failure_of(exc)
            oom = out_of_memory(exc, job.devices or PlanDevices((), ()), server)
            if oom is not None:
                blame = oom[0]
                failure = (OUT_OF_MEMORY, oom_message(blame, oom[1], exc))
        except BaseException:
            sender.discard()  # cancelled: nothing more of it is sent
            raise
        finally:
            await stream.aclose()
        await sender.flush()  # every piece before the result
        job.phase = _FINISHED  # a late CancelJob must not add a second JobResult
        if failure is not None:
            log.warning("job %s: generation failed (%s): %s", job.job_id, *failure)
            await send(
                job_failure(
                    job.job_id,
                    "execution",
                    *failure,
                    failed_node_id=blame.node_id if blame else "",
                    failed_device=blame.device if blame else "",
                    failed_bytes=blame.bytes if blame else 0,
                )
            )
            return
        stats = generation_stats(
            started=started,
            first_piece=first_piece,
            last_piece=last_piece,
            pieces=sender.next_seq,
            usage_prompt_tokens=usage.prompt_tokens if usage else None,
            usage_completion_tokens=usage.completion_tokens if usage else None,
            timings_prompt_tokens=timings.prompt_tokens if timings else None,
            timings_prompt_ms=timings.prompt_ms if timings else None,
            timings_predicted_tokens=timings.predicted_tokens if timings else None,
            timings_predicted_ms=timings.predicted_ms if timings else None,
            usage_cached_tokens=usage.cached_tokens if usage else None,
            timings_cached_tokens=timings.cached_tokens if timings else None,
        )
        log.info(
            "job %s done (%s): %d prompt (%d cached) + %d completion tokens, ttft %.0f ms, "
            "%.1f tokens/s",
            job.job_id,
            finish_reason or "stop",
            stats.prompt_tokens,
            stats.cached_prompt_tokens,
            stats.completion_tokens,
            stats.time_to_first_token_ms,
            stats.tokens_per_second,
        )
        await send(
            pb.AgentMessage(
                job_result=pb.JobResult(
                    job_id=job.job_id,
                    ok=True,
                    finish_reason=finish_reason or "stop",
                    prompt_tokens=stats.prompt_tokens,
                    completion_tokens=stats.completion_tokens,
                    time_to_first_token_ms=stats.time_to_first_token_ms,
                    tokens_per_second=stats.tokens_per_second,
                    cached_prompt_tokens=stats.cached_prompt_tokens,
                )
            )
        )

    async def _embed(
        self, job: _Job, server: LlamaServer, request: EmbeddingsRequest, send: Send
    ) -> None:
        """An embeddings job: one result carrying the vectors, no tokens."""
        if self._http is None:
            self._http = httpx.AsyncClient(verify=False)  # loopback plain HTTP: no CA bundle
        result = await embeddings_result(job.job_id, server, request, self._http)
        job.phase = _FINISHED
        await send(result)

    # -- crash reports -------------------------------------------------------------------

    def _attach(self, send: Send) -> None:
        """Remember the loop and the upstream ``send`` for reports nobody asked for."""
        self._send = send
        self._loop = asyncio.get_running_loop()

    def _on_child_exit(self, info: ProcessExit) -> None:
        """Called from a runtime watcher thread when a child exits unexpectedly."""
        loop = self._loop
        if loop is None or self._closed:
            return
        with contextlib.suppress(RuntimeError):  # loop closed meanwhile
            loop.call_soon_threadsafe(self._report_exit, info)

    def _report_exit(self, info: ProcessExit) -> None:
        send = self._send
        if send is None or self._closed:
            return
        if info.role == LlamaServer.role and self._server_users > 0:
            return  # the job using it reports the crash in its JobResult
        if info.role == RpcWorker.role and self.rpc_host.starting:
            return  # RpcWorkerStatus FAILED reports it
        guard = self.rpc_host.guard
        copying = isinstance(guard, RpcGuard) and info.role == RpcWorker.role
        behind = f" (behind {guard.endpoint})" if copying and guard is not None else ""
        message = f"{info.error()}{behind} (log: {info.log_path})"
        fault = pb.AgentMessage(runtime_fault=pb.RuntimeFault(message=message, fatal=False))
        task = asyncio.create_task(_send_one(send, fault))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _send_one(send: Send, message: pb.AgentMessage) -> None:
    await send(message)
