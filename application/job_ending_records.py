"""Recording a job's ending: its last tokens and its ending event are written in one
transaction, retried until the store takes them, and then its slots and RPC workers are freed
for the next placement."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from application.background import BackgroundTasks
from application.errors import ConcurrencyExhausted, NotFound
from application.job_calls import in_thread
from application.job_registry import JobContext
from application.store_guard import is_outage
from domain.errors import DomainError

log = logging.getLogger(__name__)

#: Backoff between attempts to record a job's ending while the store cannot take it (s).
ENDING_RETRY_FIRST, ENDING_RETRY_MAX = 0.2, 2.0


class EndingRecorder:
    """Writes endings and frees what a job held; knows which jobs have an ending under way."""

    def __init__(self, ctx: JobContext) -> None:
        self._ctx = ctx
        #: Endings being recorded (retried until the store takes them), per job.
        self._tasks = BackgroundTasks("recording a job's ending")
        self._under_way: Counter[str] = Counter()

    def under_way(self, job_id: str) -> bool:
        """Whether an ending of the job is on its way (reconciliation leaves it alone)."""
        return self._under_way[job_id] > 0

    def expect(self, job_id: str) -> None:
        """An ending of the job is on its way, to be recorded later (then :meth:`expected`)."""
        self._under_way[job_id] += 1

    def expected(self, job_id: str) -> None:
        """The ending announced with :meth:`expect` is recorded (or given up)."""
        self._under_way -= Counter({job_id: 1})

    def ended(self, job_id: str) -> None:
        """The job's ending (or release) is recorded: its slots are free for placement now."""
        self.release_workers(job_id, "job ended")
        self._ctx.scheduler.release(job_id)
        self._ctx.queue.wake()

    def release_workers(self, job_id: str, reason: str) -> None:
        """The job no longer uses its RPC workers: each worker whose set of primaries that
        changes hears the set left, so a former primary can no longer connect."""
        for node_id, allowed in self._ctx.worker_access.release(job_id).items():
            self._ctx.gateway.rpc_worker_peers(node_id, allowed, reason)

    async def record(
        self,
        job_id: str,
        end: Callable[..., Any],
        *args: Any,
        tell: Callable[[], None] = lambda: None,
        wait: bool = True,
    ) -> None:
        """Records the job's last token chunk and its ending in one transaction
        (``end(job_id, *args, chunk=...)``, a Controller ending command), then
        frees its slots. The client hears the ending (``tell``) once it is written, or at
        once when the store cannot take it now: the write is then retried with backoff until
        the store takes it (an outage, or version conflicts lost to other writers: each
        attempt reads the job afresh), so the job and its nodes never stay busy in the
        store. Unless ``wait``, only the first attempt is waited for; the retries go on in
        the background (the caller answers its client meanwhile). The ending goes on when
        the caller is cancelled."""
        self.release_workers(job_id, "job ended")
        first_refused = asyncio.Event()
        self.expect(job_id)
        task = self._tasks.spawn(self._write(job_id, end, args, tell, first_refused))
        if wait:
            await asyncio.shield(task)
            return
        refused: asyncio.Future[Any] = asyncio.ensure_future(first_refused.wait())
        try:
            waiting: set[asyncio.Future[Any]] = {task, refused}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            refused.cancel()

    async def _write(
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
            # The job's last tokens go in the ending's own transaction, on every attempt.
            last = await self._ctx.recorder.take(job_id)
            while True:
                try:
                    await in_thread(end, job_id, *args, chunk=last)
                except (DomainError, NotFound) as e:
                    log.info("%s of job %s skipped: %s", name, job_id, e)
                    self._ctx.recorder.put_back(job_id, last)  # recorded if the job takes them
                except Exception as e:
                    if not (is_outage(e) or isinstance(e, ConcurrencyExhausted)):
                        # Not the store's state but a fault: reconciliation tries again later
                        # (end_stale_jobs), rather than this in a tight loop; the next batch
                        # records the tokens meanwhile.
                        log.exception("%s of job %s failed", name, job_id)
                        self._ctx.recorder.put_back(job_id, last)
                    else:
                        if not told:
                            log.warning(
                                "job %s: recording its %s waits for the store (%r)", job_id, name, e
                            )
                            tell()
                            told = True
                            refused.set()
                        await self._ctx.settings.sleep(delay)
                        delay = min(ENDING_RETRY_MAX, delay * 2)
                        continue
                break
            if not told:
                tell()
            self.ended(job_id)
        finally:
            self.expected(job_id)
