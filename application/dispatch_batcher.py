"""New jobs are written together: one transaction for a burst, not one each.

Each new job needs one store write: placed at once (JOB_SUBMITTED, JOB_PLANNED, its nodes'
NODE_JOB_ASSIGNED and JOB_DISPATCHED), or queued (JOB_SUBMITTED and JOB_QUEUED). The event store
serialises writes (gapless notification ids), so a burst of a few hundred requests waited for a
few hundred transactions in a row. The batcher writes every new job that is waiting when the
previous write ends in one transaction (``Controller.record_new_jobs``), in the order they came:
queued jobs are recorded in queue order. If that transaction is refused (a node lost a slot to
another controller meanwhile), each job of the batch is written alone, in order, so only the job
whose slot was taken sees :class:`SlotTaken`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from application.commands import Submission
from application.controller import Controller, NewDispatch, NewQueued
from domain.errors import DomainError

log = logging.getLogger(__name__)

#: Most jobs one transaction writes.
MAX_BATCH = 200


@dataclass
class _Pending:
    job: NewDispatch | NewQueued
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class DispatchBatcher:
    def __init__(self, app: Controller) -> None:
        self.app = app
        self._pending: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self.transactions = 0  # for tests and metrics

    async def submit_and_dispatch(
        self,
        submission: Submission,
        job_id: UUID,
        plan: dict[str, Any],
        roles: Mapping[str, str],
        *,
        allow_degraded: bool = False,
        route: dict[str, Any] | None = None,
    ) -> None:
        """Returns once the job's dispatch is stored; raises what writing it alone raised."""
        await self._add(NewDispatch(submission, job_id, plan, dict(roles), allow_degraded, route))

    async def submit_and_queue(
        self, submission: Submission, job_id: UUID, position: int, reason: str
    ) -> None:
        """Returns once JOB_SUBMITTED and JOB_QUEUED are stored, after those of every job
        queued before it."""
        await self._add(NewQueued(submission, job_id, position, reason))

    async def _add(self, job: NewDispatch | NewQueued) -> None:
        pending = _Pending(job)
        self._pending.append(pending)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_all())
        await asyncio.shield(pending.done)

    async def _write_all(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            await self._write(batch)

    async def _write(self, batch: list[_Pending]) -> None:
        try:
            await asyncio.to_thread(self.app.record_new_jobs, [p.job for p in batch])
            self.transactions += 1
        except Exception as e:
            if len(batch) == 1:
                _settle(batch[0], e)
                return
            if not isinstance(e, DomainError):
                log.warning("writing %d new jobs together failed (%r); one by one", len(batch), e)
            for pending in batch:
                try:
                    await asyncio.to_thread(self.app.record_new_jobs, [pending.job])
                    self.transactions += 1
                except Exception as alone:
                    _settle(pending, alone)
                else:
                    _settle(pending, None)
            return
        for pending in batch:
            _settle(pending, None)


def _settle(pending: _Pending, error: BaseException | None) -> None:
    if pending.done.done():
        return
    if error is None:
        pending.done.set_result(None)
    else:
        pending.done.set_exception(error)
