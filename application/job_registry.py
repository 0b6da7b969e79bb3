"""What the job manager's parts share: which jobs run in this controller, the settings every
part reads, and the collaborators they all use.

:class:`RunRegistry` owns the :class:`JobRun` of each job this process runs (admitted, in
setup or executing) and answers the lookups the parts make; :class:`JobSettings` holds the
limits and the clock they read at the moment they need them (tests change them on a live
manager); :class:`JobContext` carries both with the other collaborators, built once by the
manager and handed whole to each part.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from application.admission import DEFAULT_QUEUE_TIMEOUT, AdmissionQueue
from application.background import BackgroundTasks
from application.controller import Controller
from application.deadlines import Deadlines
from application.job_run import JobRun
from application.ports import AgentGateway, Metrics
from application.scheduler import Scheduler
from application.token_recorder import TokenChunkRecorder
from application.worker_access import WorkerAccess
from domain.job import MAX_REPLANS


@dataclass
class JobSettings:
    """The limits of a job's phases, its deadlines, and the clock and sleep the parts use."""

    worker_timeout: float = 30.0
    setup_timeout: float = 120.0
    max_replans: int = MAX_REPLANS
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT
    deadlines: Deadlines = field(default_factory=Deadlines)
    clock: Callable[[], float] = time.monotonic
    #: Waits between attempts to record an ending (tests pass one that does not sleep).
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


class RunRegistry:
    """The runs of this controller's jobs, by job id: a job is here from its admission until
    its ending is decided (whoever takes it out with :meth:`pop` ends it)."""

    def __init__(self) -> None:
        self.runs: dict[str, JobRun] = {}

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.runs

    def add(self, run: JobRun) -> None:
        self.runs[run.job_id] = run

    def rename(self, run: JobRun, job_id: str) -> None:
        """``run`` goes on under ``job_id``: messages about its old id are late from now on."""
        if self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]
        run.job_id = job_id
        self.runs[job_id] = run

    def get(self, job_id: str) -> JobRun | None:
        return self.runs.get(job_id)

    def pop(self, job_id: str) -> JobRun | None:
        """Takes the job's run out (None: someone else already did, so it is theirs to end)."""
        return self.runs.pop(job_id, None)

    def holds(self, run: JobRun) -> bool:
        """Whether ``run`` is still the job's run here (no ending took it out meanwhile)."""
        return self.runs.get(run.job_id) is run

    def all(self) -> list[JobRun]:
        """A copy of the runs, safe to iterate while runs are taken out."""
        return list(self.runs.values())

    def executing(self) -> list[JobRun]:
        """The runs whose generation started (their primary validated)."""
        return [run for run in self.runs.values() if run.executing_since is not None]

    def executing_on(self, node_id: str) -> list[JobRun]:
        """The runs executing with ``node_id`` in their plan (or whose primary validated)."""
        return [
            run
            for run in self.runs.values()
            if node_id in run.nodes and (run.phase == "execution" or run.setup_ok)
        ]

    def in_setup_on(self, node_id: str) -> list[JobRun]:
        """The runs whose setup waits for ``node_id`` (in their plan, not validated yet)."""
        return [
            run
            for run in self.runs.values()
            if node_id in run.nodes and run.phase == "setup" and not run.setup_ok
        ]


@dataclass(frozen=True, slots=True)
class JobContext:
    """The collaborators the job manager's parts share, passed whole to each part."""

    app: Controller
    scheduler: Scheduler
    gateway: AgentGateway
    recorder: TokenChunkRecorder
    queue: AdmissionQueue
    #: Who may reach each node's RPC worker (the primaries of the jobs using it).
    worker_access: WorkerAccess
    metrics: Metrics
    runs: RunRegistry
    settings: JobSettings
    #: The agent messages' store writes, beside the node's message loop.
    background: BackgroundTasks
