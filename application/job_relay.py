"""The relay of agent messages into runs: each job message an agent sends is checked against
the run it names and handed on (tokens to the client's queue and the recorder, setup and
worker results to the futures the setup waits on, a job's result to its ending)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import assert_never

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
from application.commands import Delta, JobOutcome
from application.job_calls import node_label, quietly
from application.job_ending_records import EndingRecorder
from application.job_registry import JobContext
from application.job_run import JobRun, StreamItem, out_of_memory_in
from common.contract import CLIENT_ERROR_CODES, JobErrorCode

log = logging.getLogger(__name__)


class JobRelay:
    """Hands every job message of an agent to the run it is about, or says why it is refused."""

    def __init__(self, ctx: JobContext, endings: EndingRecorder) -> None:
        #: Its ``background`` runs the store writes that handling a message makes.
        self._ctx = ctx
        self._endings = endings

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
                run = self._ctx.runs.get(job_id)
                if run is not None and self._stranger(run, node_id):
                    why = "an RPC worker status for a job the node has no part in"
                    return Rejection(why, job_id)
                self._ctx.background.spawn(self._worker_status(node_id, message))
            case WorkerStopped(job_id, reason):
                # RPC_WORKER_STOPPED, while the node still serves the job.
                self._ctx.background.spawn(
                    quietly(self._ctx.app.rpc_worker_stopped, node_id, job_id, reason)
                )
            case SetupReported(job_id, outcome):
                return self._setup_reported(node_id, job_id, outcome)
            case JobFinished(job_id, result):
                run = self._ctx.runs.get(job_id)
                if run is not None and node_id == run.primary and not run.setup_ok:
                    return Rejection("a job result before the job's setup result", job_id)
                if run is not None and self._stranger(run, node_id, lead=True):
                    return Rejection("a job result for a job the node does not lead", job_id)
                self._ctx.background.spawn(self._job_finished(node_id, job_id, result))
            case _:
                assert_never(message)
        return None

    @staticmethod
    def _stranger(run: JobRun, node_id: str, *, lead: bool = False) -> bool:
        """Whether ``node_id`` has no business sending messages about ``run`` (as its
        primary, with ``lead``): neither in its plan nor in an earlier one."""
        ours = node_id == run.primary if lead else node_id in run.nodes
        return not ours and node_id not in run.past_nodes

    async def _worker_status(self, node_id: str, status: WorkerStatus) -> None:
        run = self._ctx.runs.get(status.job_id)
        future = run.worker_futures.get(node_id) if run else None
        if status.started:
            await quietly(
                self._ctx.app.rpc_worker_started, node_id, status.job_id, status.host, status.port
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
        run = self._ctx.runs.get(job_id)
        if run is None or node_id != run.primary:
            if run is not None and self._stranger(run, node_id, lead=True):
                return Rejection("a setup result for a job the node does not lead", job_id)
            return None  # late: the job ended, or a plan it was in failed meanwhile
        if run.setup_future is not None and not run.setup_future.done():
            run.setup_future.set_result(outcome)
        elif run.setup_ok and not outcome.ok:
            # The primary failed after a good setup and said so as a setup result (an agent
            # whose own fault reached its catch-all): the job fails now, as a failure in
            # execution, rather than wait for a result that will never come.
            log.warning("job %s: its primary failed after its setup: %s", job_id, outcome.error)
            failed = AgentJobResult(
                ok=False,
                error=f"the primary failed after its setup: {outcome.error or 'no reason given'}",
                error_code=JobErrorCode.EXECUTION_FAILED,
            )
            self._ctx.background.spawn(self._job_finished(node_id, job_id, failed))
        return None

    def _relay(self, node_id: str, job_id: str, deltas: list[Delta]) -> Rejection | None:
        """The relay: hand the deltas to the client now, record them later.

        The primary streams as soon as it has validated; until JOB_SETUP_VALIDATED is
        recorded the deltas are relayed but held back from the recorder.
        """
        run = self._ctx.runs.get(job_id)
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
            self._ctx.metrics.observe_time_to_first_token(now - run.submitted_at)
        else:
            self._ctx.metrics.observe_inter_token(now - run.last_token_at)
        run.last_token_at = now
        if run.validated.is_set():
            self._ctx.recorder.add(job_id, deltas)
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
        run = self._ctx.runs.get(job_id)
        if run is None or node_id != run.primary:
            return  # cancelled meanwhile, or not this node's job
        try:
            await asyncio.wait_for(run.validated.wait(), self._ctx.settings.setup_timeout)
        except TimeoutError:
            log.warning("job %s ended before its setup was recorded", job_id)
        if self._ctx.runs.pop(job_id) is None:
            return
        if result.ok:
            self._ctx.metrics.count_prompt_tokens(result.prompt_tokens, result.cached_prompt_tokens)
            outcome = JobOutcome(
                finish_reason=result.finish_reason or "stop",
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                time_to_first_token_ms=result.time_to_first_token_ms,
                tokens_per_second=result.tokens_per_second,
                cached_prompt_tokens=result.cached_prompt_tokens,
                output=result.output,
            )
            item = StreamItem("done", outcome=outcome)
        else:
            error = result.error or "generation failed"
            if result.error_code == JobErrorCode.OUT_OF_MEMORY and run.plan is not None:
                # After the first token nothing is re-planned (the client has part of its
                # answer), but the next plan gives that device less.
                node = result.failed_node_id if result.failed_node_id in run.nodes else node_id
                oom = out_of_memory_in(run.plan, node, result.failed_device, result.failed_bytes)
                self._ctx.scheduler.budgets.lower(
                    oom.node_id, oom.device, oom.planned_bytes, oom.asked_bytes
                )
                error = f"{oom.describe(node_label(self._ctx.app, oom.node_id))}: {error}"
            item = StreamItem(
                "error", error=error, error_code=result.error_code or JobErrorCode.EXECUTION_FAILED
            )
        tell = functools.partial(run.queue.put_nowait, item)
        if result.ok:
            await self._endings.record(job_id, self._ctx.app.complete, item.outcome, tell=tell)
        else:
            # A request the node refused as invalid is the client's error, not the node's.
            app = self._ctx.app
            end = app.reject if result.error_code in CLIENT_ERROR_CODES else app.fail
            await self._endings.record(job_id, end, item.error, result.error_code, tell=tell)
