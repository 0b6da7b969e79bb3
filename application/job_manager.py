"""The job manager: the three phases of a chat completion (see docs/architecture.md,
'Request flow').

*Setup and validation*: plan, dispatch, start RPC workers, let the primary validate the
model and its peers; a node that fails here is excluded and the job re-planned (bounded).
*Distributed execution* happens on the primary. *Token streaming*: deltas reach the
client's queue the moment they arrive, and are recorded in batches by the
:class:`TokenChunkRecorder`, off that path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, assert_never
from uuid import UUID, uuid4

from application.admission import (
    DEFAULT_QUEUE_TIMEOUT,
    AdmissionQueue,
    CapacityError,
    QueueTimeoutError,
    Ticket,
)
from application.agent_messages import (
    AgentJobMessage,
    AgentJobResult,
    JobFinished,
    Rejection,
    SetupOutcome,
    SetupReported,
    TokensGenerated,
    WorkerStatus,
    WorkerStopped,
)
from application.background import BackgroundTasks
from application.commands import Delta, JobOutcome, Submission
from application.controller import Controller
from application.deadlines import Deadlines
from application.dispatch_batcher import DispatchBatcher
from application.errors import ConcurrencyExhausted, NotFound
from application.job_run import (
    JobRun,
    NoCapacityError,
    OutOfMemory,
    SetupFailure,
    StreamItem,
    Unplaced,
    out_of_memory_in,
)
from application.ports import (
    AgentGateway,
    AssignedDevice,
    Metrics,
    ModelFetcher,
    NullMetrics,
    PrimaryAssignment,
    RpcPeer,
)
from application.scheduler import Scheduler
from application.store_guard import STORE_UNAVAILABLE, StoreUnavailable, is_outage
from application.token_recorder import TokenChunkRecorder
from application.worker_access import WorkerAccess, rpc_worker_nodes, worker_devices
from domain.errors import DomainError, SlotTaken
from domain.job import MAX_REPLANS
from domain.model import EMBEDDING
from domain.placement import ExecutionPlan
from domain.runtimes import runtime_of
from proto import CLIENT_ERROR_CODES, OUT_OF_MEMORY

log = logging.getLogger(__name__)

T = TypeVar("T")


#: How often one placement may lose the race for a slot before the job queues instead.
MAX_PLACEMENT_RACES = 16
#: Backoff between attempts to record a job's ending while the store cannot take it (s).
ENDING_RETRY_FIRST, ENDING_RETRY_MAX = 0.2, 2.0
#: How long a job of this controller may stay unfinished in the store with no run here, and no
#: ending on its way, before reconciliation ends it (s): its ending was lost.
STALE_JOB_GRACE = 30.0
#: The error code of a job ended so.
ABANDONED = "abandoned"
#: The error code of a job the controller ended as it stopped (SHUTDOWN_TIMEOUT passed).
CONTROLLER_STOPPING = "controller_stopping"
#: How long the jobs of an agent that said goodbye wait for its last messages to be handled
#: (the results of the jobs it drained) before the rest are lost (s).
STOPPED_SETTLE_TIMEOUT = 10.0


def capped(params: dict[str, Any], context_size: int) -> dict[str, Any]:
    """The generation parameters with ``max_tokens`` at most the context (a slot's tokens):
    none asked for is the context, more cannot be generated anyway."""
    asked = int(params.get("max_tokens") or 0)
    return {**params, "max_tokens": min(asked, context_size) if asked > 0 else context_size}


class JobManager:
    def __init__(
        self,
        app: Controller,
        scheduler: Scheduler,
        gateway: AgentGateway,
        recorder: TokenChunkRecorder,
        *,
        worker_timeout: float = 30.0,
        setup_timeout: float = 120.0,
        max_replans: int = MAX_REPLANS,
        metrics: Metrics | None = None,
        queue: AdmissionQueue | None = None,
        queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
        deadlines: Deadlines | None = None,
        clock: Callable[[], float] = time.monotonic,
        fetcher: ModelFetcher | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.metrics: Metrics = metrics or NullMetrics()
        #: Fetches a model onto a node that lacks it when no holder has room (None: never).
        self.fetcher = fetcher
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self.queue = queue if queue is not None else AdmissionQueue()
        self.queue_timeout = queue_timeout
        self.clock = clock
        #: Waits between attempts to record an ending (tests pass one that does not sleep).
        self.sleep = sleep
        self._placing = asyncio.Lock()
        self._decisions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="placement")
        self._background = BackgroundTasks("handling an agent message")
        self.dispatches = DispatchBatcher(app)
        self.app = app
        self.scheduler = scheduler
        self.gateway = gateway
        self.recorder = recorder
        self.worker_timeout = worker_timeout
        self.setup_timeout = setup_timeout
        self.max_replans = max_replans
        self.runs: dict[str, JobRun] = {}
        #: Who may reach each node's RPC worker (the primaries of the jobs using it).
        self.worker_access = WorkerAccess()
        #: Endings being recorded (retried until the store takes them), per job.
        self._endings = BackgroundTasks("recording a job's ending")
        self._ending_jobs: Counter[str] = Counter()
        #: Jobs reconciliation found unfinished with no run here, since when (``clock``).
        self._stale_since: dict[str, float] = {}

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _decide(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Scheduling decisions run in a thread of their own: queued behind store writes in
        the shared pool, each placement of a burst waited for everyone's writes."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._decisions, functools.partial(fn, *args, **kwargs))

    # ------------------------------------------------------------ lifecycle

    async def start(
        self, submission: Submission, model: dict[str, Any], job_id: UUID | None = None
    ) -> JobRun:
        """Admits the job (placing it now, or queueing it) and runs its setup phase; returns
        once the primary has validated and streams.

        Raises a :class:`CapacityError` (no capacity, queue full, queue timeout) when it
        cannot run. Cancelling the caller (the client went away) records JOB_CANCELLED.
        """
        uid = job_id or uuid4()
        run = JobRun(str(uid), submission, model)
        self.runs[run.job_id] = run
        try:
            await self._setup(run)
        except CapacityError:
            self.runs.pop(run.job_id, None)
            raise
        except asyncio.CancelledError:
            await asyncio.shield(self._abandon(run, "client disconnected", cancelled=True))
            raise
        except BaseException as e:
            # Anything else (store down): stop the primary if it was already told to run, and
            # end the job so its node slots are not held forever.
            await asyncio.shield(self._abandon(run, f"setup aborted: {e!r}", cancelled=False))
            raise
        return run

    async def _abandon(self, run: JobRun, reason: str, *, cancelled: bool) -> None:
        self.runs.pop(run.job_id, None)
        if run.ticket is not None:
            self.queue.leave(run.ticket)
            run.ticket = None
        self._cancel_on_primary(run, reason)
        if not run.recorded:
            self._ended(run.job_id)
        elif cancelled:
            await self._record_ending(run.job_id, self.app.cancel, reason, wait=False)
        else:
            await self._record_ending(run.job_id, self.app.fail, reason, "internal", wait=False)

    async def _record(self, run: JobRun, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Runs a store write that creates or places ``run``'s job to its end even when the
        caller is cancelled meanwhile (the client went away), so the ending recorded next is
        based on what was really written. ``run.recorded`` is set once the job exists."""
        await self._record_async(run, self._call(fn, *args, **kwargs))

    async def _record_async(self, run: JobRun, write: Awaitable[None]) -> None:
        """:meth:`_record` for a write given as an awaitable (the dispatch batcher's)."""
        task = asyncio.ensure_future(write)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is None:
                run.recorded = True
            raise
        run.recorded = True

    def capacity_changed(self) -> None:
        """A slot may have come free (or a node joined): the head of every queue tries."""
        self.queue.wake()

    def _ended(self, job_id: str) -> None:
        """The job's ending (or release) is recorded: its slots are free for placement now."""
        self._release_workers(job_id, "job ended")
        self.scheduler.ledger.released(job_id)
        self.capacity_changed()

    def _release_workers(self, job_id: str, reason: str) -> None:
        """The job no longer uses its RPC workers: each worker whose set of primaries that
        changes hears the set left, so a former primary can no longer connect."""
        for node_id, allowed in self.worker_access.release(job_id).items():
            self.gateway.rpc_worker_peers(node_id, allowed, reason)

    async def _setup(self, run: JobRun) -> None:
        failure: SetupFailure | None = None
        for _attempt in range(self.max_replans + 1):
            plan = await self._admit(run, failure)
            run.plan, run.nodes, run.primary = plan, set(plan.node_ids), plan.primary.node_id
            failure = await self._validate(run, plan)
            if failure is None:
                # The primary streams already; JOB_SETUP_VALIDATED is written meanwhile,
                # off the first token's path (its tokens are recorded once it is).
                run.phase = "execution"
                run.executing_since = time.monotonic()
                self._background.spawn(self._record_validation(run))
                return
            reason, blamed = failure.reason, failure.blamed
            run.past_nodes |= run.nodes  # their late answers are expected, not protocol errors
            self._cancel_on_primary(run, f"re-planning: {reason}")
            self._release_workers(run.job_id, "job re-planned")
            await self._call(self.app.release_nodes, run.job_id, "replanning")
            self.scheduler.ledger.released(run.job_id)
            log.warning(
                "job %s setup failed (%s); re-planning without %s",
                run.job_id,
                reason,
                blamed or "-",
            )
            if failure.out_of_memory is not None:
                # Not the node's fault as a whole: that device gets less for a while, and the
                # next plan takes it into account (it may still use the node's other devices).
                oom = failure.out_of_memory
                self.scheduler.budgets.lower(
                    oom.node_id, oom.device, oom.planned_bytes, oom.asked_bytes
                )
            elif blamed:
                run.excluded.add(blamed)
        assert failure is not None
        why = f"setup failed after {self.max_replans + 1} plans: {failure.reason}"
        await self._record_ending(run.job_id, self.app.fail, why, "setup_failed", wait=False)
        raise NoCapacityError(why)

    async def _record_validation(self, run: JobRun) -> None:
        try:
            await self._call(self.app.validate_setup, run.job_id)
        except DomainError:
            if self.runs.get(run.job_id) is run:  # no ending raced with it: a bug
                log.exception("job %s: its setup could not be recorded", run.job_id)
            return  # cancelled or ended meanwhile; its ending released the slots
        except Exception as e:
            if self.runs.pop(run.job_id, None) is None:
                return
            log.error("job %s: recording its setup failed: %r", run.job_id, e)
            self._cancel_on_primary(run, "the controller could not record the job")
            # The store going away is the client's to retry (503), not a generation failure.
            outage = isinstance(e, StoreUnavailable) or is_outage(e)
            code = STORE_UNAVAILABLE if outage else "store_error"
            run.queue.put_nowait(
                StreamItem("error", error=f"recording the job failed: {e}", error_code=code)
            )
            why = f"store error: {e}"
            await self._record_ending(run.job_id, self.app.fail, why, "store_error", wait=False)
            return
        if run.held:
            self.recorder.add(run.job_id, run.held)
            run.held = []
        run.validated.set()

    async def _admit(self, run: JobRun, failure: SetupFailure | None) -> ExecutionPlan:
        """A dispatched plan for the job: placed at once, or after waiting in the queue.

        A new request for a model whose queue is not empty joins the queue (first come,
        first served); a re-plan tries at once, as its job already waited its turn.
        """
        if failure is not None or self.queue.depth(run.model) == 0:
            placed = await self._place(run, failure)
            if isinstance(placed, ExecutionPlan):
                return placed
            if not placed.transient or failure is not None:
                raise await self._no_capacity(run, placed.reason, failure)
            reason = placed.reason
        else:
            reason = f"{self.queue.depth(run.model)} request(s) for {run.model} wait already"
        return await self._wait_in_queue(run, reason)

    async def _no_capacity(
        self, run: JobRun, reason: str, failure: SetupFailure | None
    ) -> NoCapacityError:
        """Records the job's failure (submitting it first if need be) and returns the error."""
        why = f"{reason}; earlier attempt failed: {failure.reason}" if failure else reason
        if not run.recorded:
            await self._record(run, self.app.submit, run.submission, run.uid)
        await self._record_ending(run.job_id, self.app.fail, why, "no_capacity", wait=False)
        return NoCapacityError(why)

    async def _wait_in_queue(self, run: JobRun, reason: str) -> ExecutionPlan:
        queued_at = self.clock()
        deadline = queued_at + self.queue_timeout
        ticket: Ticket | None = None
        try:
            ticket = self.queue.join(run.model, run.job_id)  # QueueFullError: no record
            run.ticket = ticket
            # Joined and handed to the batcher with no await between: the store lists
            # JOB_QUEUED in queue order (the batcher writes new jobs in the order they came).
            await self._record_async(
                run,
                self.dispatches.submit_and_queue(run.submission, run.uid, ticket.position, reason),
            )
            while True:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise await self._queue_timeout(run, ticket)
                try:
                    async with asyncio.timeout(remaining):
                        await ticket.wakeup.wait()
                except TimeoutError:
                    raise await self._queue_timeout(run, ticket) from None
                ticket.wakeup.clear()
                if not self.queue.is_head(ticket):
                    continue
                placed = await self._place(run, None)
                if isinstance(placed, ExecutionPlan):
                    self.metrics.observe_queue_wait(self.clock() - queued_at)
                    return placed
                if not placed.transient:
                    raise await self._no_capacity(run, placed.reason, None)
        finally:
            if ticket is not None:
                self.queue.leave(ticket)
            run.ticket = None

    async def _queue_timeout(self, run: JobRun, ticket: Ticket) -> QueueTimeoutError:
        why = (
            f"waited {self.queue_timeout:g} s in the admission queue for model {run.model} "
            f"(joined at position {ticket.position}) and no slot came free"
        )
        self.metrics.observe_queue_wait(self.queue_timeout)
        await self._record_ending(run.job_id, self.app.fail, why, "queue_timeout", wait=False)
        return QueueTimeoutError(why)

    async def _place(self, run: JobRun, failure: SetupFailure | None) -> ExecutionPlan | Unplaced:
        """Plans and dispatches in one transaction, or says why not.

        Placements in this process take turns, so they never pick the same free slot; the
        store's version check refuses a slot that another controller took meanwhile
        (:class:`SlotTaken`), which costs a fresh placement, never a re-plan or an event.
        """
        for _race in range(MAX_PLACEMENT_RACES):
            async with self._placing:
                result = await self._decide(
                    self.scheduler.place,
                    run.model_row,
                    frozenset(run.excluded),
                    connected=self.gateway.is_connected,
                )
                for v in result.violations:
                    if v.node_id not in run.reported_violations:  # once per job and node
                        run.reported_violations.add(v.node_id)
                        await self._quietly(
                            self.app.security_violation, v.node_id, v.address, v.reason, run.job_id
                        )
                if result.plan is None:
                    assert result.no_capacity is not None
                    return await self._unplaced(run, result.no_capacity.reason)
                plan = result.plan
                roles = {plan.primary.node_id: "primary"}
                roles.update({w.node_id: "worker" for w in plan.workers})
                # Reserved here before the write, so the next placement sees the slot taken
                # and need not wait for this write: bursts of requests write side by side.
                self.scheduler.ledger.assigned(run.job_id, roles, runtime_of(plan))
            try:
                await self._dispatch(run, plan, roles, result.fallback_used, failure)
            except SlotTaken as e:
                self.scheduler.ledger.released(run.job_id)  # nothing was written
                log.info("job %s: a planned slot was taken meanwhile (%s)", run.job_id, e)
                try:
                    await self._call(self.scheduler.catch_up)  # learn who took it
                except TimeoutError:
                    # Views far behind under load: place again without them; the store's
                    # version check still refuses a slot that is taken.
                    log.info("job %s: read model behind; placing again", run.job_id)
                continue
            return plan
        return Unplaced(f"lost the race for a slot {MAX_PLACEMENT_RACES} times", transient=True)

    async def _dispatch(
        self,
        run: JobRun,
        plan: ExecutionPlan,
        roles: dict[str, str],
        degraded: bool,
        failure: SetupFailure | None,
    ) -> None:
        """Records the plan and the dispatch in one transaction (submitting the job too)."""
        if not run.recorded:
            await self._record_async(
                run,
                self.dispatches.submit_and_dispatch(
                    run.submission, run.uid, plan.to_dict(), roles, allow_degraded=degraded
                ),
            )
        else:
            await self._record(
                run,
                self.app.plan_and_dispatch,
                run.job_id,
                plan.to_dict(),
                roles,
                allow_degraded=degraded,
                replan_reason=failure.reason if failure else None,
                excluded_node=failure.blamed if failure and not failure.out_of_memory else "",
                out_of_memory=failure.out_of_memory.to_dict()
                if failure and failure.out_of_memory
                else None,
            )

    async def _unplaced(self, run: JobRun, reason: str) -> Unplaced:
        """Whether waiting can help: would a plan fit if every busy slot were free?"""
        idle = await self._decide(
            self.scheduler.place,
            run.model_row,
            frozenset(run.excluded),
            connected=self.gateway.is_connected,
            assume_idle=True,
        )
        # No room where the file is: a node that lacks it may fetch it and run the job.
        fetching = self.fetcher is not None and self.fetcher.fetch_for(run.model_row)
        return Unplaced(reason, transient=idle.plan is not None or fetching)

    async def _validate(self, run: JobRun, plan: ExecutionPlan) -> SetupFailure | None:
        """Starts RPC workers and lets the primary validate; why it failed, or None."""
        loop = asyncio.get_running_loop()
        workers = rpc_worker_nodes(plan)
        if workers:
            run.worker_futures = {n.node_id: loop.create_future() for n in workers}
            self.worker_access.use(run.job_id, plan)
            for node in workers:
                # Only the primaries of the jobs using a worker may reach it (their agents'
                # gate): the exact set, which replaces the one before.
                allowed = self.worker_access.allowed(node.node_id)
                devices = worker_devices(plan, node.node_id)
                if not self.gateway.start_rpc_worker(
                    node.node_id, run.job_id, node.address, node.rpc_port, allowed, devices
                ):
                    why = f"node {self._label(node.node_id)} is not connected"
                    return SetupFailure(why, node.node_id)
            for node_id, future in run.worker_futures.items():
                try:
                    outcome = await asyncio.wait_for(asyncio.shield(future), self.worker_timeout)
                except TimeoutError:
                    why = f"RPC worker on node {self._label(node_id)} did not start in time"
                    return SetupFailure(why, node_id)
                if not outcome.ok:
                    why = f"RPC worker on node {self._label(node_id)} failed: {outcome.error}"
                    return self._setup_failure(why, plan, node_id, outcome)
        multi = bool(plan.workers)
        endpoints = {n.node_id: f"{n.address}:{n.rpc_port}" for n in plan.nodes}
        assignment = PrimaryAssignment(
            job_id=run.job_id,
            model_name=run.model_row["name"],
            model_file_name=run.model_row["file_name"],
            model_sha256=run.model_row["sha256"],
            context_size=plan.context_size,
            parallel=plan.parallel,
            rpc_peers=tuple(RpcPeer(n.node_id, n.address, n.rpc_port) for n in workers),
            tensor_split=plan.tensor_split if multi else (),
            messages=run.submission.messages,
            params=capped(run.submission.params, plan.context_size),
            embeddings=run.model_row.get("kind") == EMBEDDING,
            pooling=str(run.model_row.get("pooling") or ""),
            devices=tuple(
                AssignedDevice(
                    node_id=d.node_id,
                    device=d.device,
                    endpoint=endpoints[d.node_id] if d.via_rpc else "",
                    share=d.share,
                    assigned_bytes=d.assigned_bytes,
                )
                for d in plan.devices
            ),
            n_gpu_layers=plan.n_gpu_layers,
        )
        run.setup_future = loop.create_future()
        if not self.gateway.assign_primary(run.primary, assignment):
            why = f"primary node {self._label(run.primary)} is not connected"
            return SetupFailure(why, run.primary)
        try:
            result = await asyncio.wait_for(asyncio.shield(run.setup_future), self.setup_timeout)
        except TimeoutError:
            why = f"primary node {self._label(run.primary)} did not validate setup in time"
            return SetupFailure(why, run.primary)
        if not result.ok:
            why = f"{result.error_code or 'setup_failed'}: {result.error}"
            return self._setup_failure(why, plan, result.failed_node_id or run.primary, result)
        return None

    def _setup_failure(
        self, why: str, plan: ExecutionPlan, blamed: str, outcome: SetupOutcome
    ) -> SetupFailure:
        """``blamed``'s failure; when a device of it ran out of memory, which one and what the
        plan gave it (said first in the reason)."""
        oom = self._out_of_memory(plan, blamed, outcome)
        if oom is not None:
            why = f"{OUT_OF_MEMORY}: {oom.describe(self._label(blamed))}; {why}"
        return SetupFailure(why, blamed, oom)

    @staticmethod
    def _out_of_memory(
        plan: ExecutionPlan, node_id: str, outcome: SetupOutcome
    ) -> OutOfMemory | None:
        """The device that ran out and what the plan gave it, when ``outcome`` says one did."""
        if outcome.error_code != OUT_OF_MEMORY or node_id not in plan.node_ids:
            return None
        return out_of_memory_in(plan, node_id, outcome.failed_device, outcome.failed_bytes)

    async def cancel(self, job_id: str, reason: str) -> None:
        """Client went away: stop generation on the primary and record JOB_CANCELLED."""
        run = self.runs.pop(job_id, None)
        if run is None:
            return
        if run.ticket is not None:
            self.queue.leave(run.ticket)
        if run.primary:
            self.gateway.cancel_job(run.primary, job_id, reason)
        await self._record_ending(job_id, self.app.cancel, reason)

    def enforce_deadlines(self, now: float | None = None) -> list[str]:
        """Ends every job past one of its deadlines (:mod:`application.deadlines`) as
        JOB_FAILED with the deadline's code, tells its client and stops its primary; returns
        the ids of the jobs it ended. The controller calls it every half second."""
        at = time.monotonic() if now is None else now
        ended = []
        for run in list(self.runs.values()):
            missed = self.deadlines.missed(
                at,
                submitted_at=run.submitted_at,
                executing_since=run.executing_since,
                last_token_at=run.last_token_at,
            )
            if missed is None or run.executing_since is None:
                continue  # a job still in setup or queued has its own limits
            code, why = missed
            self.runs.pop(run.job_id, None)
            log.warning("job %s: %s", run.job_id, why)
            self._cancel_on_primary(run, why)
            self._ending_jobs[run.job_id] += 1  # reconciliation leaves it alone meanwhile
            self._background.spawn(self._end_past_deadline(run, why, code))
            ended.append(run.job_id)
        return ended

    async def end_executing(self, why: str, code: str) -> list[str]:
        """Ends every job that executes now as JOB_FAILED with ``code`` (the controller
        stops and waited long enough): its client hears ``why``, its primary stops; returns
        their ids once the endings are recorded. Jobs still in setup or queued end with their
        requests."""
        runs = [run for run in self.runs.values() if run.executing_since is not None]
        for run in runs:
            self.runs.pop(run.job_id, None)
            log.warning("job %s: %s", run.job_id, why)
            self._cancel_on_primary(run, why)
            self._ending_jobs[run.job_id] += 1
        await asyncio.gather(*(self._end_past_deadline(run, why, code) for run in runs))
        return [run.job_id for run in runs]

    async def _end_past_deadline(self, run: JobRun, why: str, code: str) -> None:
        # Its tokens so far are recorded once JOB_SETUP_VALIDATED is: wait for that first,
        # so they land before the ending, in the execution phase.
        try:
            try:
                await asyncio.wait_for(run.validated.wait(), self.setup_timeout)
            except TimeoutError:
                log.warning("job %s passed a deadline before its setup was recorded", run.job_id)
            tell = functools.partial(
                run.queue.put_nowait, StreamItem("error", error=why, error_code=code)
            )
            await self._record_ending(run.job_id, self.app.fail, why, code, tell=tell)
        finally:
            self._ending_jobs -= Counter({run.job_id: 1})

    def _label(self, node_id: str) -> str:
        """``name (id prefix)`` for messages people read; the id alone if unknown."""
        try:
            return f"{self.app.get_node(node_id).name} ({node_id[:8]})"
        except (NotFound, ValueError):
            return node_id

    def _cancel_on_primary(self, run: JobRun, reason: str) -> None:
        """Tells the primary to stop generating (it keeps its runtime otherwise busy)."""
        if run.primary and run.setup_future is not None:
            self.gateway.cancel_job(run.primary, run.job_id, reason)

    async def _record_ending(
        self,
        job_id: str,
        end: Callable[..., Any],
        *args: Any,
        tell: Callable[[], None] = lambda: None,
        wait: bool = True,
    ) -> None:
        """Records the job's last token chunk and its ending (``end(job_id, *args)``), then
        frees its slots. The client hears the ending (``tell``) once it is written, or at
        once when the store cannot take it now: the write is then retried with backoff until
        the store takes it (an outage, or version conflicts lost to other writers: each
        attempt reads the job afresh), so the job and its nodes never stay busy in the
        store. Unless ``wait``, only the first attempt is waited for; the retries go on in
        the background (the caller answers its client meanwhile). The ending goes on when
        the caller is cancelled."""
        self._release_workers(job_id, "job ended")
        first_refused = asyncio.Event()
        self._ending_jobs[job_id] += 1
        task = self._endings.spawn(self._write_ending(job_id, end, args, tell, first_refused))
        if wait:
            await asyncio.shield(task)
            return
        refused: asyncio.Future[Any] = asyncio.ensure_future(first_refused.wait())
        try:
            waiting: set[asyncio.Future[Any]] = {task, refused}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            refused.cancel()

    async def _write_ending(
        self,
        job_id: str,
        end: Callable[..., Any],
        args: tuple[Any, ...],
        tell: Callable[[], None],
        refused: asyncio.Event,
    ) -> None:
        name = getattr(end, "__name__", "ending")
        delay, told = ENDING_RETRY_FIRST, False
        try:
            while True:
                try:
                    await self.recorder.flush(job_id)
                    await self._call(end, job_id, *args)
                except (DomainError, NotFound) as e:
                    log.info("%s of job %s skipped: %s", name, job_id, e)
                except Exception as e:
                    if not (is_outage(e) or isinstance(e, ConcurrencyExhausted)):
                        # Not the store's state but a fault: reconciliation tries again later
                        # (end_stale_jobs), rather than this in a tight loop.
                        log.exception("%s of job %s failed", name, job_id)
                    else:
                        if not told:
                            log.warning(
                                "job %s: recording its %s waits for the store (%r)", job_id, name, e
                            )
                            tell()
                            told = True
                            refused.set()
                        await self.sleep(delay)
                        delay = min(ENDING_RETRY_MAX, delay * 2)
                        continue
                break
            if not told:
                tell()
            self._ended(job_id)
        finally:
            self._ending_jobs -= Counter({job_id: 1})

    async def _quietly(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs a command that is no job's ending on a path that must go on whatever happens
        to the command (a security violation, an RPC worker's start or stop): a refusal or a
        store error is logged. Endings go through :meth:`_record_ending`, which retries."""
        try:
            await self._call(fn, *args)
        except (DomainError, NotFound) as e:
            log.info("%s skipped: %s", getattr(fn, "__name__", fn), e)
        except Exception:
            log.exception("%s failed", getattr(fn, "__name__", fn))

    # ----------------------------------------------------- messages from agents

    async def handle(self, node_id: str, message: AgentJobMessage) -> Rejection | None:
        """Every job message an agent sends, by kind; each kind is handled exactly once.

        Returns at once: the kinds that write to the store run as tasks, so a slow or frozen
        store never holds up the node's message loop (its heartbeats, other jobs' tokens).
        Tokens are relayed before a later ``JobFinished`` of the same job is looked at.

        Returns why the message was refused when it breaks the protocol: about a running job
        the node has no part in, or out of order. A message about a job that has ended, or
        from a node an earlier plan of the job used, is dropped quietly: it was late."""
        match message:
            case TokensGenerated(job_id, deltas):
                return self._relay(node_id, job_id, deltas)
            case WorkerStatus(job_id):
                run = self.runs.get(job_id)
                if run is not None and self._stranger(run, node_id):
                    why = "an RPC worker status for a job the node has no part in"
                    return Rejection(why, job_id)
                self._background.spawn(self._worker_status(node_id, message))
            case WorkerStopped(job_id, reason):
                # RPC_WORKER_STOPPED, while the node still serves the job.
                self._background.spawn(
                    self._quietly(self.app.rpc_worker_stopped, node_id, job_id, reason)
                )
            case SetupReported(job_id, outcome):
                return self._setup_reported(node_id, job_id, outcome)
            case JobFinished(job_id, result):
                run = self.runs.get(job_id)
                if run is not None and node_id == run.primary and not run.setup_ok:
                    return Rejection("a job result before the job's setup result", job_id)
                if run is not None and self._stranger(run, node_id, lead=True):
                    return Rejection("a job result for a job the node does not lead", job_id)
                self._background.spawn(self._job_finished(node_id, job_id, result))
            case _:
                assert_never(message)
        return None

    @staticmethod
    def _stranger(run: JobRun, node_id: str, *, lead: bool = False) -> bool:
        """Whether ``node_id`` has no business sending messages about ``run`` (as its
        primary, with ``lead``): neither in its plan nor in an earlier one."""
        ours = node_id == run.primary if lead else node_id in run.nodes
        return not ours and node_id not in run.past_nodes

    async def settle(self) -> None:
        """Waits until every agent message handed over so far is fully handled (tests)."""
        await self._background.settle()

    async def _worker_status(self, node_id: str, status: WorkerStatus) -> None:
        run = self.runs.get(status.job_id)
        future = run.worker_futures.get(node_id) if run else None
        if status.started:
            await self._quietly(
                self.app.rpc_worker_started, node_id, status.job_id, status.host, status.port
            )
        if future is not None and not future.done():
            future.set_result(
                SetupOutcome(
                    ok=status.started,
                    error=status.error,
                    error_code=status.error_code,
                    failed_node_id=node_id,
                    failed_device=status.failed_device,
                    failed_bytes=status.failed_bytes,
                )
            )

    def _setup_reported(self, node_id: str, job_id: str, outcome: SetupOutcome) -> Rejection | None:
        run = self.runs.get(job_id)
        if run is None or node_id != run.primary:
            if run is not None and self._stranger(run, node_id, lead=True):
                return Rejection("a setup result for a job the node does not lead", job_id)
            return None  # late: the job ended, or a plan it was in failed meanwhile
        if run.setup_future is not None and not run.setup_future.done():
            run.setup_future.set_result(outcome)
        return None

    def _relay(self, node_id: str, job_id: str, deltas: list[Delta]) -> Rejection | None:
        """The relay: hand the deltas to the client now, record them later.

        The primary streams as soon as it has validated; until JOB_SETUP_VALIDATED is
        recorded the deltas are relayed but held back from the recorder.
        """
        run = self.runs.get(job_id)
        if run is None:
            log.debug("tokens for ended job %s from node %s dropped", job_id, node_id)
            return None
        if node_id != run.primary:
            if self._stranger(run, node_id, lead=True):
                return Rejection("tokens for a job the node does not lead", job_id)
            return None  # from the primary of a plan that failed: late
        if run.next_seq == 0 and not run.setup_ok:
            return Rejection("tokens before the job's setup result", job_id)
        if deltas[0].seq != run.next_seq:  # re-sent after a reconnect, or a gap
            deltas = self._unseen(run, deltas)
            if not deltas:
                return None
        run.next_seq = deltas[-1].seq + 1
        run.queue.put_nowait(StreamItem("deltas", deltas=tuple(deltas)))
        now = time.monotonic()
        if run.last_token_at is None:
            self.metrics.observe_time_to_first_token(now - run.submitted_at)
        else:
            self.metrics.observe_inter_token(now - run.last_token_at)
        run.last_token_at = now
        if run.validated.is_set():
            self.recorder.add(job_id, deltas)
        else:
            run.held.extend(deltas)
        return None

    @staticmethod
    def _unseen(run: JobRun, deltas: list[Delta]) -> list[Delta]:
        """``deltas`` without those already relayed (an agent re-sends from the last
        sequence number the controller confirmed, so some may have arrived before)."""
        fresh = [d for d in deltas if d.seq >= run.next_seq]
        if fresh and fresh[0].seq != run.next_seq:
            log.warning(
                "job %s: tokens %d to %d never arrived",
                run.job_id,
                run.next_seq,
                fresh[0].seq - 1,
            )
        return fresh

    async def _job_finished(self, node_id: str, job_id: str, result: AgentJobResult) -> None:
        run = self.runs.get(job_id)
        if run is None or node_id != run.primary:
            return  # cancelled meanwhile, or not this node's job
        try:
            await asyncio.wait_for(run.validated.wait(), self.setup_timeout)
        except TimeoutError:
            log.warning("job %s ended before its setup was recorded", job_id)
        if self.runs.pop(job_id, None) is None:
            return
        if result.ok:
            outcome = JobOutcome(
                finish_reason=result.finish_reason or "stop",
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                time_to_first_token_ms=result.time_to_first_token_ms,
                tokens_per_second=result.tokens_per_second,
                output=result.output,
            )
            item = StreamItem("done", outcome=outcome)
        else:
            error = result.error or "generation failed"
            if result.error_code == OUT_OF_MEMORY and run.plan is not None:
                # After the first token nothing is re-planned (the client has part of its
                # answer), but the next plan gives that device less.
                node = result.failed_node_id if result.failed_node_id in run.nodes else node_id
                oom = out_of_memory_in(run.plan, node, result.failed_device, result.failed_bytes)
                self.scheduler.budgets.lower(
                    oom.node_id, oom.device, oom.planned_bytes, oom.asked_bytes
                )
                error = f"{oom.describe(self._label(oom.node_id))}: {error}"
            item = StreamItem(
                "error", error=error, error_code=result.error_code or "execution_failed"
            )
        tell = functools.partial(run.queue.put_nowait, item)
        if result.ok:
            await self._record_ending(job_id, self.app.complete, item.outcome, tell=tell)
        else:
            # A request the node refused as invalid is the client's error, not the node's.
            end = self.app.reject if result.error_code in CLIENT_ERROR_CODES else self.app.fail
            await self._record_ending(job_id, end, item.error, result.error_code, tell=tell)

    def node_disconnected(self, node_id: str) -> None:
        """A node's stream closed (or a new one replaced it): the setups waiting for it fail
        over at once, as what it answered may be lost. Executions go on: the agent keeps
        what it sends meanwhile and re-sends it when it is back (:meth:`resumed_jobs`), or
        :meth:`node_gone` ends them."""
        lost = SetupOutcome(
            ok=False,
            error=f"node {self._label(node_id)} disconnected",
            error_code="NODE_LOST",
            failed_node_id=node_id,
        )
        for run in list(self.runs.values()):
            if node_id in run.nodes and run.phase == "setup" and not run.setup_ok:
                future = run.worker_futures.get(node_id)
                if future is not None and not future.done():
                    future.set_result(lost)
                if run.setup_future is not None and not run.setup_future.done():
                    run.setup_future.set_result(lost)

    def resumed_jobs(self, node_id: str) -> list[tuple[str, int]]:
        """The jobs executing on ``node_id`` that go on over its new stream, each with the
        first token sequence number not received yet (the ``Welcome`` names them)."""
        return [(run.job_id, run.next_seq) for run in self._executing_on(node_id)]

    def _executing_on(self, node_id: str) -> list[JobRun]:
        return [
            run
            for run in self.runs.values()
            if node_id in run.nodes and (run.phase == "execution" or run.setup_ok)
        ]

    async def messages_handled(self) -> None:
        """Waits until the agent messages handed over so far are handled (not those that come
        meanwhile), at most STOPPED_SETTLE_TIMEOUT: an agent that said goodbye has its last
        results (the jobs it drained) recorded before its stop, which would count them lost."""
        running = self._background.running()
        if running:
            await asyncio.wait(running, timeout=STOPPED_SETTLE_TIMEOUT)

    async def node_gone(self, node_id: str, stopped: str = "") -> None:
        """A node stayed disconnected past the reconnect grace, or its agent stopped
        (``stopped``: why, as it said in its goodbye): the executions on it are lost (failed
        as ``node_lost``; a job on a lost RPC worker is stopped first)."""
        label = self._label(node_id)
        executing = self._executing_on(node_id)
        await asyncio.gather(*(self._lose(run, node_id, label, stopped) for run in executing))

    async def _lose(self, run: JobRun, node_id: str, label: str, stopped: str = "") -> None:
        """Ends an executing job whose node was lost; the client hears it whatever happens."""
        cause = f": its agent stopped ({stopped})" if stopped else ""
        item = StreamItem(
            "error",
            error=f"node {label} was lost during execution{cause}; "
            "uninterrupted generation is not guaranteed",
            error_code="node_lost",
        )
        # The primary validated; wait until that is recorded so the failure is recorded in
        # the execution phase, where it happened.
        try:
            await asyncio.wait_for(run.validated.wait(), self.setup_timeout)
        except TimeoutError:
            log.warning("job %s lost its node before its setup was recorded", run.job_id)
        if self.runs.pop(run.job_id, None) is None:
            run.queue.put_nowait(item)
            self._ended(run.job_id)
            return
        if node_id != run.primary:
            self._cancel_on_primary(run, f"RPC worker node {label} lost")
        why = f"node {label} lost during execution{cause}"
        tell = functools.partial(run.queue.put_nowait, item)
        await self._record_ending(run.job_id, self.app.fail, why, "node_lost", tell=tell)

    async def fail_orphans(self, describe: Callable[[], Awaitable[list[str]]]) -> int:
        """Fails jobs a previous controller process left unfinished (e.g. after a crash)."""
        count = 0
        for job_id in await describe():
            if job_id in self.runs or self._ending_jobs[job_id]:
                continue
            why = "controller restarted during the job"
            await self._record_ending(
                job_id, self.app.fail, why, "controller_restarted", wait=False
            )
            count += 1
        return count

    async def end_stale_jobs(
        self, describe: Callable[[], Awaitable[list[str]]], grace: float = STALE_JOB_GRACE
    ) -> list[str]:
        """Ends this controller's own jobs that the store shows unfinished (``describe``:
        their ids) while no run here holds them and no ending is on its way, once they have
        stayed so for ``grace`` seconds: their ending was lost (before endings were retried,
        a store outage during setup left them DISPATCHED, holding their nodes' slots until a
        restart). Each is failed as ``abandoned`` (JOB_FAILED) and its slots come free;
        returns their ids. The controller's reconciliation calls it every
        RECONCILE_INTERVAL."""
        listed = await describe()
        now = self.clock()
        stale = {j for j in listed if j not in self.runs and not self._ending_jobs[j]}
        self._stale_since = {j: self._stale_since.get(j, now) for j in stale}
        due = sorted(j for j, since in self._stale_since.items() if now - since >= grace)
        for job_id in due:
            del self._stale_since[job_id]
            log.warning("job %s: unfinished in the store with no run here; ending it", job_id)
            why = f"its controller lost track of it for {grace:g}s (its ending was not recorded)"
            await self._record_ending(job_id, self.app.fail, why, ABANDONED, wait=False)
        return due
