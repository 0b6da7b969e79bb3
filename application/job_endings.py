"""The endings of runs that do not end by themselves: a client that went away, a deadline
passed, a controller that stops, a node lost during execution (and the setups waiting for a
node that disconnected), and jobs of the store that no run here holds any more (orphans of
an earlier process, stale jobs whose ending was lost)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from application.agent_messages import SetupOutcome
from application.job_calls import cancel_on_primary, node_label
from application.job_ending_records import EndingRecorder
from application.job_registry import JobContext
from application.job_run import JobRun, StreamItem
from common.contract import JobErrorCode

log = logging.getLogger(__name__)

#: How long a job of this controller may stay unfinished in the store with no run here, and no
#: ending on its way, before reconciliation ends it (s): its ending was lost.
STALE_JOB_GRACE = 30.0
#: The error code of a job ended so.
ABANDONED = "abandoned"
#: The error code of a job the controller ended as it stopped (SHUTDOWN_TIMEOUT passed).
CONTROLLER_STOPPING = "controller_stopping"


class JobEndings:
    """Ends the runs (and stored jobs) that something outside them ends."""

    def __init__(self, ctx: JobContext, endings: EndingRecorder) -> None:
        #: Its ``background`` is where a deadline's ending is recorded (beside the agents').
        self._ctx = ctx
        self._endings = endings
        #: Jobs reconciliation found unfinished with no run here, since when (``clock``).
        self._stale_since: dict[str, float] = {}

    async def cancel(self, job_id: str, reason: str) -> None:
        """Client went away: stop generation on the primary and record JOB_CANCELLED."""
        run = self._ctx.runs.pop(job_id)
        if run is None:
            return
        if run.ticket is not None:
            self._ctx.queue.leave(run.ticket)
        if run.primary:
            self._ctx.gateway.cancel_job(run.primary, job_id, reason)
        await self._endings.record(job_id, self._ctx.app.cancel, reason)

    def enforce_deadlines(self, now: float | None = None) -> list[str]:
        """Ends every job past one of its deadlines (:mod:`application.deadlines`) as
        JOB_FAILED with the deadline's code, tells its client and stops its primary; returns
        the ids of the jobs it ended. The controller calls it every half second."""
        at = time.monotonic() if now is None else now
        ended = []
        for run in self._ctx.runs.all():
            missed = self._ctx.settings.deadlines.missed(
                at,
                submitted_at=run.submitted_at,
                executing_since=run.executing_since,
                last_token_at=run.last_token_at,
            )
            if missed is None or run.executing_since is None:
                continue  # a job still in setup or queued has its own limits
            code, why = missed
            self._ctx.runs.pop(run.job_id)
            log.warning("job %s: %s", run.job_id, why)
            cancel_on_primary(self._ctx.gateway, run, why)
            self._endings.expect(run.job_id)  # reconciliation leaves it alone meanwhile
            self._ctx.background.spawn(self._end_past_deadline(run, why, code))
            ended.append(run.job_id)
        return ended

    async def end_executing(self, why: str, code: str) -> list[str]:
        """Ends every job that executes now as JOB_FAILED with ``code`` (the controller
        stops and waited long enough): its client hears ``why``, its primary stops; returns
        their ids once the endings are recorded. Jobs still in setup or queued end with their
        requests."""
        runs = self._ctx.runs.executing()
        for run in runs:
            self._ctx.runs.pop(run.job_id)
            log.warning("job %s: %s", run.job_id, why)
            cancel_on_primary(self._ctx.gateway, run, why)
            self._endings.expect(run.job_id)
        await asyncio.gather(*(self._end_past_deadline(run, why, code) for run in runs))
        return [run.job_id for run in runs]

    async def _end_past_deadline(self, run: JobRun, why: str, code: str) -> None:
        # Its tokens so far are recorded once JOB_SETUP_VALIDATED is: wait for that first,
        # so they land before the ending, in the execution phase.
        try:
            try:
                await asyncio.wait_for(run.validated.wait(), self._ctx.settings.setup_timeout)
            except TimeoutError:
                log.warning("job %s passed a deadline before its setup was recorded", run.job_id)
            tell = functools.partial(
                run.queue.put_nowait, StreamItem("error", error=why, error_code=code)
            )
            await self._endings.record(run.job_id, self._ctx.app.fail, why, code, tell=tell)
        finally:
            self._endings.expected(run.job_id)

    def node_disconnected(self, node_id: str) -> None:
        """A node's stream closed (or a new one replaced it): the setups waiting for it fail
        over at once, as what it answered may be lost. Executions go on: the agent keeps
        what it sends meanwhile and re-sends it when it is back (:meth:`resumed_jobs`), or
        :meth:`node_gone` ends them."""
        lost = SetupOutcome(
            ok=False,
            error=f"node {node_label(self._ctx.app, node_id)} disconnected",
            error_code=JobErrorCode.NODE_LOST,
            failed_node_id=node_id,
        )
        for run in self._ctx.runs.in_setup_on(node_id):
            future = run.worker_futures.get(node_id)
            if future is not None and not future.done():
                future.set_result(lost)
            if run.setup_future is not None and not run.setup_future.done():
                run.setup_future.set_result(lost)

    def resumed_jobs(self, node_id: str) -> list[tuple[str, int]]:
        """The jobs executing on ``node_id`` that go on over its new stream, each with the
        first token sequence number not received yet (the ``Welcome`` names them)."""
        return [(run.job_id, run.next_seq) for run in self._ctx.runs.executing_on(node_id)]

    async def node_gone(self, node_id: str, stopped: str = "") -> None:
        """A node stayed disconnected past the reconnect grace, or its agent stopped
        (``stopped``: why, as it said in its goodbye): the executions on it are lost (failed
        as ``node_lost``; a job on a lost RPC worker is stopped first), and the prefix router
        forgets the caches of the servers it ran."""
        label = node_label(self._ctx.app, node_id)
        self._ctx.scheduler.router.forget_node(node_id)
        executing = self._ctx.runs.executing_on(node_id)
        await asyncio.gather(*(self._lose(run, node_id, label, stopped) for run in executing))

    async def _lose(self, run: JobRun, node_id: str, label: str, stopped: str = "") -> None:
        """Ends an executing job whose node was lost; the client hears it whatever happens."""
        cause = f": its agent stopped ({stopped})" if stopped else ""
        item = StreamItem(
            "error",
            error=f"node {label} was lost during execution{cause}; "
            "uninterrupted generation is not guaranteed",
            error_code=JobErrorCode.NODE_LOST_IN_EXECUTION,
        )
        # The primary validated; wait until that is recorded so the failure is recorded in
        # the execution phase, where it happened.
        try:
            await asyncio.wait_for(run.validated.wait(), self._ctx.settings.setup_timeout)
        except TimeoutError:
            log.warning("job %s lost its node before its setup was recorded", run.job_id)
        if self._ctx.runs.pop(run.job_id) is None:
            run.queue.put_nowait(item)
            self._endings.ended(run.job_id)
            return
        if node_id != run.primary:
            cancel_on_primary(self._ctx.gateway, run, f"RPC worker node {label} lost")
        why = f"node {label} lost during execution{cause}"
        tell = functools.partial(run.queue.put_nowait, item)
        await self._endings.record(
            run.job_id, self._ctx.app.fail, why, JobErrorCode.NODE_LOST_IN_EXECUTION, tell=tell
        )

    async def fail_orphans(self, describe: Callable[[], Awaitable[list[str]]]) -> int:
        """Fails jobs a previous controller process left unfinished (e.g. after a crash)."""
        count = 0
        for job_id in await describe():
            if job_id in self._ctx.runs or self._endings.under_way(job_id):
                continue
            why = "controller restarted during the job"
            await self._endings.record(
                job_id, self._ctx.app.fail, why, JobErrorCode.CONTROLLER_RESTARTED, wait=False
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
        now = self._ctx.settings.clock()
        stale = {j for j in listed if j not in self._ctx.runs and not self._endings.under_way(j)}
        self._stale_since = {j: self._stale_since.get(j, now) for j in stale}
        due = sorted(j for j, since in self._stale_since.items() if now - since >= grace)
        for job_id in due:
            del self._stale_since[job_id]
            log.warning("job %s: unfinished in the store with no run here; ending it", job_id)
            why = f"its controller lost track of it for {grace:g}s (its ending was not recorded)"
            await self._endings.record(job_id, self._ctx.app.fail, why, ABANDONED, wait=False)
        return due
