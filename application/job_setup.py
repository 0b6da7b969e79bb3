"""Admission and setup of a job: admit it (place it now, or queue it), place and dispatch
its plan, start its RPC workers and let its primary validate; re-plan without the node to
blame when that fails (bounded), until the primary streams."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar
from uuid import UUID, uuid4

from application.admission import (
    AdmissionQueue,
    CapacityError,
    QueueTimeoutError,
    Ticket,
    may_pass,
)
from application.agent_messages import SetupOutcome
from application.background import BackgroundTasks
from application.commands import JobParams, Submission
from application.controller import Controller
from application.decision_runner import DecisionRunner
from application.dispatch_batcher import DispatchBatcher
from application.job_calls import cancel_on_primary, in_thread, node_label, quietly
from application.job_ending_records import EndingRecorder
from application.job_registry import JobSettings, RunRegistry
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
    PrimaryAssignment,
    RpcPeer,
)
from application.scheduler import Scheduler
from application.store_guard import STORE_UNAVAILABLE, StoreUnavailable, is_outage
from application.token_recorder import TokenChunkRecorder
from application.worker_access import WorkerAccess, rpc_worker_nodes, worker_devices
from common.contract import JobErrorCode
from domain.errors import DomainError, SlotTaken
from domain.model import EMBEDDING
from domain.placement import WAITS_FOR_CACHE, ExecutionPlan
from domain.runtimes import runtime_of

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often one placement may lose the race for a slot before the job queues instead.
MAX_PLACEMENT_RACES = 16


def capped(params: JobParams, context_size: int) -> JobParams:
    """The generation parameters with ``max_tokens`` at most the context (a slot's tokens):
    none asked for is the context, more cannot be generated anyway."""
    asked = params.max_tokens or 0
    return replace(params, max_tokens=min(asked, context_size) if asked > 0 else context_size)


class JobSetup:
    """Takes a job from its request to a validated plan whose primary streams."""

    def __init__(
        self,
        app: Controller,
        scheduler: Scheduler,
        gateway: AgentGateway,
        recorder: TokenChunkRecorder,
        *,
        runs: RunRegistry,
        settings: JobSettings,
        queue: AdmissionQueue,
        dispatches: DispatchBatcher,
        worker_access: WorkerAccess,
        metrics: Metrics,
        fetcher: ModelFetcher | None,
        endings: EndingRecorder,
        background: BackgroundTasks,
    ) -> None:
        self._app = app
        self._scheduler = scheduler
        self._gateway = gateway
        self._recorder = recorder
        self._runs = runs
        self._settings = settings
        self._queue = queue
        self._dispatches = dispatches
        self._worker_access = worker_access
        self._metrics = metrics
        #: Fetches a model onto a node that lacks it when no holder has room (None: never).
        self._fetcher = fetcher
        self._endings = endings
        #: Where JOB_SETUP_VALIDATED is recorded, off the first token's path.
        self._background = background
        self._placing = asyncio.Lock()
        self._decisions = DecisionRunner()

    def _label(self, node_id: str) -> str:
        return node_label(self._app, node_id)

    async def _decide(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A scheduling decision: on the event loop while decisions are quick, else in a
        thread of their own (:class:`DecisionRunner`)."""
        return await self._decisions.run(fn, *args, **kwargs)

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
        run.prefix = self._scheduler.router.chain(submission.prompt)
        self._runs.add(run)
        try:
            await self._setup(run)
        except CapacityError:
            self._runs.pop(run.job_id)
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
        self._runs.pop(run.job_id)
        if run.ticket is not None:
            self._queue.leave(run.ticket)
            run.ticket = None
        cancel_on_primary(self._gateway, run, reason)
        if not run.recorded:
            self._endings.ended(run.job_id)
        elif cancelled:
            await self._endings.record(run.job_id, self._app.cancel, reason, wait=False)
        else:
            await self._endings.record(
                run.job_id, self._app.fail, reason, JobErrorCode.INTERNAL, wait=False
            )

    async def _record(self, run: JobRun, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Runs a store write that creates or places ``run``'s job to its end even when the
        caller is cancelled meanwhile (the client went away), so the ending recorded next is
        based on what was really written. ``run.recorded`` is set once the job exists."""
        await self._record_async(run, in_thread(fn, *args, **kwargs))

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

    async def _setup(self, run: JobRun) -> None:
        failure: SetupFailure | None = None
        for _attempt in range(self._settings.max_replans + 1):
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
            cancel_on_primary(self._gateway, run, f"re-planning: {reason}")
            self._endings.release_workers(run.job_id, "job re-planned")
            await in_thread(self._app.release_nodes, run.job_id, "replanning")
            self._scheduler.release(run.job_id)
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
                self._scheduler.budgets.lower(
                    oom.node_id, oom.device, oom.planned_bytes, oom.asked_bytes
                )
            elif blamed:
                run.excluded.add(blamed)
        assert failure is not None
        why = f"setup failed after {self._settings.max_replans + 1} plans: {failure.reason}"
        await self._endings.record(
            run.job_id, self._app.fail, why, JobErrorCode.SETUP_FAILED, wait=False
        )
        raise NoCapacityError(why)

    async def _record_validation(self, run: JobRun) -> None:
        try:
            await in_thread(self._app.validate_setup, run.job_id)
        except Exception as e:
            if self._runs.pop(run.job_id) is None:
                return  # cancelled or ended meanwhile; its ending released the slots
            if isinstance(e, DomainError):  # no ending raced with it: a bug, yet the client
                # hears of it now rather than wait for the setup timeout
                log.exception("job %s: the store refused its setup", run.job_id)
            else:
                log.error("job %s: recording its setup failed: %r", run.job_id, e)
            cancel_on_primary(self._gateway, run, "the controller could not record the job")
            # The store going away is the client's to retry (503), not a generation failure.
            outage = isinstance(e, StoreUnavailable) or is_outage(e)
            code = STORE_UNAVAILABLE if outage else JobErrorCode.STORE_ERROR
            run.queue.put_nowait(
                StreamItem("error", error=f"recording the job failed: {e}", error_code=code)
            )
            why = f"store error: {e}"
            await self._endings.record(
                run.job_id, self._app.fail, why, JobErrorCode.STORE_ERROR, wait=False
            )
            return
        if run.held:
            self._recorder.add(run.job_id, run.held)
            run.held = []
        run.validated.set()

    async def _admit(self, run: JobRun, failure: SetupFailure | None) -> ExecutionPlan:
        """A dispatched plan for the job: placed at once, or after waiting in the queue.

        A new request for a model whose queue is not empty joins the queue (it goes in the
        queue's order: application/admission.py); a re-plan tries at once, as its job
        already waited its turn.
        """
        if failure is not None or self._queue.depth(run.model) == 0:
            placed = await self._place(run, failure, wait_for_cache=failure is None)
            if isinstance(placed, ExecutionPlan):
                return placed
            if not placed.transient or failure is not None:
                raise await self._no_capacity(run, placed.reason, failure)
            reason = placed.reason
        else:
            reason = f"{self._queue.depth(run.model)} request(s) for {run.model} wait already"
        return await self._wait_in_queue(run, reason)

    async def _no_capacity(
        self, run: JobRun, reason: str, failure: SetupFailure | None
    ) -> NoCapacityError:
        """Records the job's failure (submitting it first if need be) and returns the error."""
        why = f"{reason}; earlier attempt failed: {failure.reason}" if failure else reason
        if not run.recorded:
            await self._record(run, self._app.submit, run.submission, run.uid)
        await self._endings.record(
            run.job_id, self._app.fail, why, JobErrorCode.NO_CAPACITY, wait=False
        )
        return NoCapacityError(why)

    async def _wait_in_queue(self, run: JobRun, reason: str) -> ExecutionPlan:
        queued_at = self._settings.clock()
        deadline = queued_at + self._settings.queue_timeout
        ticket: Ticket | None = None
        try:
            # QueueFullError: no record
            ticket = self._queue.join(run.model, run.job_id, run.prefix, run.submission.grant)
            run.ticket = ticket
            # Joined and handed to the batcher with no await between: the store lists
            # JOB_QUEUED in queue order (the batcher writes new jobs in the order they came).
            await self._record_async(
                run,
                self._dispatches.submit_and_queue(run.submission, run.uid, ticket.position, reason),
            )
            while True:
                remaining = deadline - self._settings.clock()
                if remaining <= 0:
                    raise await self._queue_timeout(run, ticket)
                try:
                    async with asyncio.timeout(remaining):
                        await ticket.wakeup.wait()
                except TimeoutError:
                    raise await self._queue_timeout(run, ticket) from None
                ticket.wakeup.clear()
                if not self._queue.is_head(ticket) or await self._waits_for_cache(run, ticket):
                    continue
                placed = await self._place(run, None)
                if isinstance(placed, ExecutionPlan):
                    self._queue.dispatched(ticket)  # its key's turn is used
                    self._metrics.observe_queue_wait(self._settings.clock() - queued_at)
                    return placed
                if not placed.transient:
                    raise await self._no_capacity(run, placed.reason, None)
        finally:
            if ticket is not None:
                self._queue.leave(ticket)
            run.ticket = None

    async def _waits_for_cache(self, run: JobRun, head: Ticket) -> bool:
        """Whether the head (``run``'s ticket) waits on: a request behind it went first
        because a free slot's server holds its conversation's prefix, or every request looked
        at waits for the busy server that holds its own (within the queue's bounds:
        :meth:`AdmissionQueue.overtakers`, :func:`may_pass`)."""
        behind = self._queue.overtakers(head)
        if not head.chain and not any(ticket.chain for ticket in behind):
            return False
        looked_at = [head, *behind]
        async with self._placing:
            first, passed = await self._decide(
                self._scheduler.next_to_go,
                run.model_row,
                [(ticket.chain, may_pass(ticket)) for ticket in looked_at],
                connected=self._gateway.is_connected,
            )
        if first == 0 or not self._queue.is_head(head):
            return False
        self._queue.passed([looked_at[position] for position in passed])
        if first is None:
            return True
        chosen = looked_at[first]
        if chosen not in self._queue.overtakers(head):  # it left meanwhile
            return False
        self._queue.promote(chosen)
        return True

    async def _queue_timeout(self, run: JobRun, ticket: Ticket) -> QueueTimeoutError:
        waited = self._settings.queue_timeout
        why = (
            f"waited {waited:g} s in the admission queue for model {run.model} "
            f"(joined at position {ticket.position}) and no slot came free"
        )
        self._metrics.observe_queue_wait(waited)
        await self._endings.record(
            run.job_id, self._app.fail, why, JobErrorCode.QUEUE_TIMEOUT, wait=False
        )
        return QueueTimeoutError(why)

    async def _place(
        self, run: JobRun, failure: SetupFailure | None, *, wait_for_cache: bool = False
    ) -> ExecutionPlan | Unplaced:
        """Plans and dispatches in one transaction, or says why not (``wait_for_cache``:
        :meth:`Scheduler.place`'s).

        Placements in this process take turns, so they never pick the same free slot; the
        store's version check refuses a slot that another controller took meanwhile
        (:class:`SlotTaken`), which costs a fresh placement, never a re-plan or an event.
        """
        router = self._scheduler.router
        for _race in range(MAX_PLACEMENT_RACES):
            async with self._placing:
                result = await self._decide(
                    self._scheduler.place,
                    run.model_row,
                    frozenset(run.excluded),
                    connected=self._gateway.is_connected,
                    prefix=run.prefix,
                    wait_for_cache=wait_for_cache,
                )
                for v in result.violations:
                    if v.node_id not in run.reported_violations:  # once per job and node
                        run.reported_violations.add(v.node_id)
                        await quietly(
                            self._app.security_violation, v.node_id, v.address, v.reason, run.job_id
                        )
                if result.plan is None:
                    assert result.no_capacity is not None
                    if result.no_capacity.code == WAITS_FOR_CACHE:
                        return Unplaced(result.no_capacity.reason, transient=True)
                    return await self._unplaced(run, result.no_capacity.reason)
                plan = result.plan
                if plan.workers and not result.warm and self._fetcher is not None:
                    # Replicas before splits: the split serves this job now, and a node
                    # that could run the model alone fetches it for the next ones.
                    self._fetcher.fetch_replica(run.model_row)
                roles = {plan.primary.node_id: "primary"}
                roles.update({w.node_id: "worker" for w in plan.workers})
                # Reserved here before the write, so the next placement sees the slot taken
                # and need not wait for this write: bursts of requests write side by side.
                self._scheduler.ledger.assigned(run.job_id, roles, runtime_of(plan))
            # A new job on a warm server's free slot: its primary is told before the write.
            # Not a job the store holds already (queued): see the SlotTaken case below.
            early = result.warm and not plan.workers and failure is None
            early = early and not run.raced and not run.recorded
            try:
                route = router.route_of(run.submission.prompt, result.route)
                if early:
                    await self._dispatch_at_once(run, plan, roles, result.fallback_used, route)
                else:
                    await self._dispatch(run, plan, roles, result.fallback_used, failure, route)
                if route is not None:
                    self._metrics.count_prefix_route(str(route.get("prefix")))
            except SlotTaken as e:
                self._scheduler.release(run.job_id)  # nothing was written
                run.raced = True  # told the primary once already: record first from now on
                log.info("job %s: a planned slot was taken meanwhile (%s)", run.job_id, e)
                if early:
                    # Its primary heard of the job and was told to stop, and its answers
                    # (setup result, tokens) may still come. The store holds nothing of the
                    # job, so it goes on under a new id, and they are dropped as late: under
                    # the same id they would pass for the answers to its next plan, on the
                    # same node or not.
                    old = run.job_id
                    self._runs.rename(run, str(uuid4()))
                    log.info("job %s goes on as job %s", old, run.job_id)
                try:
                    await in_thread(self._scheduler.catch_up)  # learn who took it
                except TimeoutError:
                    # Views far behind under load: place again without them; the store's
                    # version check still refuses a slot that is taken.
                    log.info("job %s: read model behind; placing again", run.job_id)
                continue
            return plan
        return Unplaced(f"lost the race for a slot {MAX_PLACEMENT_RACES} times", transient=True)

    async def _dispatch_at_once(
        self,
        run: JobRun,
        plan: ExecutionPlan,
        roles: dict[str, str],
        degraded: bool,
        route: dict[str, Any] | None,
    ) -> None:
        """A warm one-node plan: its primary is told to run the job while the dispatch is
        being recorded, so the transaction is off the first token's path. The primary's
        answers wait for the records as they always do (its result for JOB_SETUP_VALIDATED,
        which follows the dispatch). If the store refuses the dispatch, the primary is told
        to stop and the store's error stands."""
        run.plan, run.nodes, run.primary = plan, set(plan.node_ids), plan.primary.node_id
        run.setup_future = asyncio.get_running_loop().create_future()
        run.assigned_early = self._gateway.assign_primary(run.primary, self._assignment(run, plan))
        try:
            await self._dispatch(run, plan, roles, degraded, None, route)
        except BaseException:
            if run.assigned_early:
                cancel_on_primary(self._gateway, run, "its dispatch could not be recorded")
            run.assigned_early = False
            run.setup_future = None
            raise

    async def _dispatch(
        self,
        run: JobRun,
        plan: ExecutionPlan,
        roles: dict[str, str],
        degraded: bool,
        failure: SetupFailure | None,
        route: dict[str, Any] | None = None,
    ) -> None:
        """Records the plan and the dispatch in one transaction (submitting the job too), with
        how its server was chosen (``route``)."""
        if not run.recorded:
            await self._record_async(
                run,
                self._dispatches.submit_and_dispatch(
                    run.submission,
                    run.uid,
                    plan.to_dict(),
                    roles,
                    allow_degraded=degraded,
                    route=route,
                ),
            )
        else:
            await self._record(
                run,
                self._app.plan_and_dispatch,
                run.job_id,
                plan.to_dict(),
                roles,
                allow_degraded=degraded,
                replan_reason=failure.reason if failure else None,
                excluded_node=failure.blamed if failure and not failure.out_of_memory else "",
                out_of_memory=failure.out_of_memory.to_dict()
                if failure and failure.out_of_memory
                else None,
                route=route,
            )

    async def _unplaced(self, run: JobRun, reason: str) -> Unplaced:
        """Whether waiting can help: would a plan fit if every busy slot were free?"""
        idle = await self._decide(
            self._scheduler.place,
            run.model_row,
            frozenset(run.excluded),
            connected=self._gateway.is_connected,
            assume_idle=True,
        )
        # No room where the file is: a node that lacks it may fetch it and run the job.
        fetching = self._fetcher is not None and self._fetcher.fetch_for(run.model_row)
        return Unplaced(reason, transient=idle.plan is not None or fetching)

    async def _validate(self, run: JobRun, plan: ExecutionPlan) -> SetupFailure | None:
        """Starts RPC workers and lets the primary validate; why it failed, or None."""
        loop = asyncio.get_running_loop()
        workers = rpc_worker_nodes(plan)
        if workers:
            run.worker_futures = {n.node_id: loop.create_future() for n in workers}
            self._worker_access.use(run.job_id, plan)
            for node in workers:
                # Only the primaries of the jobs using a worker may reach it (their agents'
                # gate): the exact set, which replaces the one before.
                allowed = self._worker_access.allowed(node.node_id)
                devices = worker_devices(plan, node.node_id)
                if not self._gateway.start_rpc_worker(
                    node.node_id, run.job_id, node.address, node.rpc_port, allowed, devices
                ):
                    why = f"node {self._label(node.node_id)} is not connected"
                    return SetupFailure(why, node.node_id)
            for node_id, future in run.worker_futures.items():
                try:
                    outcome = await asyncio.wait_for(
                        asyncio.shield(future), self._settings.worker_timeout
                    )
                except TimeoutError:
                    why = f"RPC worker on node {self._label(node_id)} did not start in time"
                    return SetupFailure(why, node_id)
                if not outcome.ok:
                    why = f"RPC worker on node {self._label(node_id)} failed: {outcome.error}"
                    return self._setup_failure(why, plan, node_id, outcome)
        if run.assigned_early:  # told while its dispatch was being recorded
            run.assigned_early = False
            return await self._setup_result(run, plan)
        run.setup_future = loop.create_future()
        if not self._gateway.assign_primary(run.primary, self._assignment(run, plan)):
            why = f"primary node {self._label(run.primary)} is not connected"
            return SetupFailure(why, run.primary)
        return await self._setup_result(run, plan)

    async def _setup_result(self, run: JobRun, plan: ExecutionPlan) -> SetupFailure | None:
        """Waits for the primary's setup result; why it failed, or None."""
        assert run.setup_future is not None
        try:
            result = await asyncio.wait_for(
                asyncio.shield(run.setup_future), self._settings.setup_timeout
            )
        except TimeoutError:
            why = f"primary node {self._label(run.primary)} did not validate setup in time"
            return SetupFailure(why, run.primary)
        if not result.ok:
            why = f"{result.error_code or JobErrorCode.SETUP_FAILED}: {result.error}"
            return self._setup_failure(why, plan, result.failed_node_id or run.primary, result)
        return None

    @staticmethod
    def _assignment(run: JobRun, plan: ExecutionPlan) -> PrimaryAssignment:
        """What the primary of ``plan`` is told to set up and run for ``run``."""
        workers = rpc_worker_nodes(plan)
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
            prompt=run.submission.prompt,
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
            host_bytes=plan.primary_host_bytes,
        )
        return assignment

    def _setup_failure(
        self, why: str, plan: ExecutionPlan, blamed: str, outcome: SetupOutcome
    ) -> SetupFailure:
        """``blamed``'s failure; when a device of it ran out of memory, which one and what the
        plan gave it (said first in the reason)."""
        oom = self._out_of_memory(plan, blamed, outcome)
        if oom is not None:
            why = f"{JobErrorCode.OUT_OF_MEMORY}: {oom.describe(self._label(blamed))}; {why}"
        return SetupFailure(why, blamed, oom)

    @staticmethod
    def _out_of_memory(
        plan: ExecutionPlan, node_id: str, outcome: SetupOutcome
    ) -> OutOfMemory | None:
        """The device that ran out and what the plan gave it, when ``outcome`` says one did."""
        if outcome.error_code != JobErrorCode.OUT_OF_MEMORY or node_id not in plan.node_ids:
            return None
        return out_of_memory_in(plan, node_id, outcome.failed_device, outcome.failed_bytes)
