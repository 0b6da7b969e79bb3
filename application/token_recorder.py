"""Records TOKEN_STREAM_CHUNK events in batches, off the relay path.

Deltas are relayed to the client the moment they arrive; this recorder only collects them
and, every ``interval``, records one chunk per job for all jobs in one transaction. A job's
ending takes its pending deltas (:meth:`TokenChunkRecorder.take`) and records them as its last
chunk in the ending's own transaction, so its chunks always precede JOB_COMPLETED /
JOB_FAILED / JOB_CANCELLED in the store, and the ending costs one transaction, not two.
"""

from __future__ import annotations

import asyncio
import logging

from application.commands import Delta
from application.controller import Controller
from application.errors import NotFound
from domain.errors import DomainError

log = logging.getLogger(__name__)


class TokenChunkRecorder:
    def __init__(self, app: Controller, interval: float = 1.0) -> None:
        self.app = app
        self.interval = interval
        self._pending: dict[str, list[Delta]] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # transactions written (for tests and metrics)

    def add(self, job_id: str, deltas: list[Delta]) -> None:
        """Never blocks: the relay path only appends to a list."""
        self._pending.setdefault(job_id, []).extend(deltas)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="token-chunk-recorder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.flush_all()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.flush_all()
            except Exception:
                log.exception("recording token chunks failed")

    async def flush_all(self) -> None:
        async with self._lock:
            batch, self._pending = self._pending, {}
            await self._record(batch)

    async def take(self, job_id: str) -> list[Delta]:
        """``job_id``'s pending deltas, no longer pending: its ending records them. Waits for a
        batch being recorded, so that what it took is recorded after that batch."""
        async with self._lock:
            return self._pending.pop(job_id, [])

    def put_back(self, job_id: str, deltas: list[Delta]) -> None:
        """Deltas taken for an ending that was not recorded: pending again, before newer
        ones (the next batch records them while the job still takes tokens)."""
        if deltas:
            self._put_back({job_id: deltas})

    def _put_back(self, batch: dict[str, list[Delta]]) -> None:
        """A batch the store could not take goes back in front of newer deltas."""
        for job_id, deltas in batch.items():
            self._pending[job_id] = deltas + self._pending.get(job_id, [])

    async def _record(self, batch: dict[str, list[Delta]]) -> None:
        if not batch:
            return
        try:
            await self._record_or_split(batch)
        except Exception:
            log.exception("recording %d jobs' token chunks failed; will retry", len(batch))
            self._put_back(batch)
            raise

    async def _record_or_split(self, batch: dict[str, list[Delta]]) -> None:
        try:
            await asyncio.to_thread(self.app.record_token_chunks, batch)
            self.batches += 1
        except (DomainError, NotFound) as e:
            # One job's chunk was refused (it ended meanwhile): record the others alone.
            log.info("token batch refused (%s); recording job by job", e)
            for job_id, deltas in batch.items():
                try:
                    await asyncio.to_thread(self.app.record_token_chunks, {job_id: deltas})
                    self.batches += 1
                except (DomainError, NotFound) as err:
                    log.warning("dropped %d deltas of job %s: %s", len(deltas), job_id, err)
