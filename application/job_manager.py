"""The job manager: the three phases of a chat completion (see docs/request-flow.md,
'Request flow'), behind one façade whose parts each hold one responsibility.

*Setup and validation* (:class:`JobSetup`, application/job_setup.py): admit, plan,
dispatch, start RPC workers, let the primary validate the model and its peers; a node that
fails here is excluded and the job re-planned (bounded). *Distributed execution* happens on
the primary. *Token streaming* (:class:`JobRelay`, application/job_relay.py): deltas reach
the client's queue the moment they arrive, and are recorded in batches by the
:class:`TokenChunkRecorder`, off that path. *Endings* that come from outside a run
(:class:`JobEndings`, application/job_endings.py) and the recording of every ending
(:class:`EndingRecorder`, application/job_ending_records.py). The parts share the runs
(:class:`RunRegistry`) and the settings (:class:`JobSettings`) of application/job_registry.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar
from uuid import UUID

from application.admission import DEFAULT_QUEUE_TIMEOUT, AdmissionQueue
from application.agent_messages import AgentJobMessage, Rejection
from application.background import BackgroundTasks
from application.commands import Submission
from application.controller import Controller
from application.deadlines import Deadlines
from application.dispatch_batcher import DispatchBatcher
from application.job_ending_records import ENDING_RETRY_FIRST, ENDING_RETRY_MAX, EndingRecorder
from application.job_endings import ABANDONED, CONTROLLER_STOPPING, STALE_JOB_GRACE, JobEndings
from application.job_registry import JobContext, JobSettings, RunRegistry
from application.job_relay import JobRelay
from application.job_run import JobRun
from application.job_setup import MAX_PLACEMENT_RACES, JobSetup, capped
from application.ports import AgentGateway, Metrics, ModelFetcher, NullMetrics
from application.scheduler import Scheduler
from application.token_recorder import TokenChunkRecorder
from application.worker_access import WorkerAccess
from domain.job import MAX_REPLANS

__all__ = [
    "ABANDONED",
    "CONTROLLER_STOPPING",
    "ENDING_RETRY_FIRST",
    "ENDING_RETRY_MAX",
    "MAX_PLACEMENT_RACES",
    "STALE_JOB_GRACE",
    "STOPPED_SETTLE_TIMEOUT",
    "JobManager",
    "capped",
]

#: How long the jobs of an agent that said goodbye wait for its last messages to be handled
#: (the results of the jobs it drained) before the rest are lost (s).
STOPPED_SETTLE_TIMEOUT = 10.0

T = TypeVar("T")


class _Setting(Generic[T]):
    """One of a manager's :class:`JobSettings`, read and written as its attribute: the parts
    read the settings when they need them, so a change on a live manager (tests) applies."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, manager: JobManager, owner: type | None = None) -> T:
        value: T = getattr(manager.settings, self._name)
        return value

    def __set__(self, manager: JobManager, value: T) -> None:
        setattr(manager.settings, self._name, value)


class JobManager:
    """The entry points of the job manager; each is delegated to the part that holds it."""

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
        self.queue = queue if queue is not None else AdmissionQueue()
        self.dispatches = DispatchBatcher(app)
        self.app = app
        self.scheduler = scheduler
        self.gateway = gateway
        self.recorder = recorder
        self.settings = JobSettings(
            worker_timeout=worker_timeout,
            setup_timeout=setup_timeout,
            max_replans=max_replans,
            queue_timeout=queue_timeout,
            deadlines=deadlines if deadlines is not None else Deadlines(),
            clock=clock,
            sleep=sleep,
        )
        self.registry = RunRegistry()
        self.runs: dict[str, JobRun] = self.registry.runs
        self.worker_access = WorkerAccess()
        ctx = JobContext(
            app,
            scheduler,
            gateway,
            recorder,
            self.queue,
            self.worker_access,
            self.metrics,
            self.registry,
            self.settings,
            BackgroundTasks("handling an agent message"),
        )
        self._background = ctx.background
        self._endings = EndingRecorder(ctx)
        self._setup = JobSetup(
            app,
            scheduler,
            gateway,
            recorder,
            runs=ctx.runs,
            settings=ctx.settings,
            queue=ctx.queue,
            dispatches=self.dispatches,
            worker_access=ctx.worker_access,
            metrics=ctx.metrics,
            fetcher=fetcher,
            endings=self._endings,
            background=ctx.background,
        )
        self._relay = JobRelay(ctx, self._endings)
        self._ends = JobEndings(ctx, self._endings)

    # --------------------------------------------- settings read where they are used

    worker_timeout = _Setting[float]()
    setup_timeout = _Setting[float]()
    max_replans = _Setting[int]()
    queue_timeout = _Setting[float]()
    deadlines = _Setting[Deadlines]()
    clock = _Setting[Callable[[], float]]()
    #: Waits between attempts to record an ending (tests pass one that does not sleep).
    sleep = _Setting[Callable[[float], Awaitable[None]]]()

    # ------------------------------------------------------------ lifecycle

    async def start(
        self, submission: Submission, model: dict[str, Any], job_id: UUID | None = None
    ) -> JobRun:
        """Admits the job and runs its setup phase (:meth:`JobSetup.start`)."""
        return await self._setup.start(submission, model, job_id)

    def capacity_changed(self) -> None:
        """A slot may have come free (or a node joined): the head of every queue tries."""
        self.queue.wake()

    async def cancel(self, job_id: str, reason: str) -> None:
        """Client went away: stop generation on the primary and record JOB_CANCELLED."""
        await self._ends.cancel(job_id, reason)

    def enforce_deadlines(self, now: float | None = None) -> list[str]:
        """Ends every job past one of its deadlines (:meth:`JobEndings.enforce_deadlines`)."""
        return self._ends.enforce_deadlines(now)

    async def end_executing(self, why: str, code: str) -> list[str]:
        """Ends every job that executes now (:meth:`JobEndings.end_executing`)."""
        return await self._ends.end_executing(why, code)

    # ----------------------------------------------------- messages from agents

    async def handle(self, node_id: str, message: AgentJobMessage) -> Rejection | None:
        """Every job message an agent sends (:meth:`JobRelay.handle`); why it was refused."""
        return await self._relay.handle(node_id, message)

    async def settle(self) -> None:
        """Waits until every agent message handed over so far is fully handled (tests)."""
        await self._background.settle()

    async def messages_handled(self) -> None:
        """Waits until the agent messages handed over so far are handled (not those that come
        meanwhile), at most STOPPED_SETTLE_TIMEOUT: an agent that said goodbye has its last
        results (the jobs it drained) recorded before its stop, which would count them lost."""
        running = self._background.running()
        if running:
            await asyncio.wait(running, timeout=STOPPED_SETTLE_TIMEOUT)

    def node_disconnected(self, node_id: str) -> None:
        """A node's stream closed: its setups fail over (:meth:`JobEndings.node_disconnected`)."""
        self._ends.node_disconnected(node_id)

    def resumed_jobs(self, node_id: str) -> list[tuple[str, int]]:
        """The jobs executing on ``node_id`` that go on over its new stream, each with the
        first token sequence number not received yet (the ``Welcome`` names them)."""
        return self._ends.resumed_jobs(node_id)

    async def node_gone(self, node_id: str, stopped: str = "") -> None:
        """A node is lost: the executions on it fail (:meth:`JobEndings.node_gone`)."""
        await self._ends.node_gone(node_id, stopped)

    # ------------------------------------------------------------ reconciliation

    async def fail_orphans(self, describe: Callable[[], Awaitable[list[str]]]) -> int:
        """Fails jobs a previous controller process left unfinished (e.g. after a crash)."""
        return await self._ends.fail_orphans(describe)

    async def end_stale_jobs(
        self, describe: Callable[[], Awaitable[list[str]]], grace: float = STALE_JOB_GRACE
    ) -> list[str]:
        """Ends this controller's own jobs that the store shows unfinished while no run here
        holds them and no ending is on its way, once so for ``grace`` seconds
        (:meth:`JobEndings.end_stale_jobs`); returns their ids."""
        return await self._ends.end_stale_jobs(describe, grace)
