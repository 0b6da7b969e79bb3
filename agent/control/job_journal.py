"""What the agent sent for each job it leads, kept so a dropped control stream loses nothing.

Every ``TokenChunk`` and ``JobResult`` the agent sends is written here first, whether or not
the stream is up. When the agent connects again, the controller's ``Welcome`` names the jobs
it still waits for and the first token sequence number it lacks of each
(``ResumedJob.next_seq``); :meth:`JobJournal.replay` gives the messages to send again, from
that number on, then the job's result if it has one. The controller drops deltas it already
has (by ``seq``), so a message that reached it before the stream died is harmless when
replayed. A job the ``Welcome`` does not name is over for the controller, and its journal is
dropped (:meth:`JobJournal.keep_only`).

The journal is bounded: a finished job's entry is kept for ``retention`` seconds, and at most
``max_finished`` finished jobs are kept. A running job's entry is as large as its output.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from wire import control_pb2 as pb

#: How long the journal of a finished job is kept for a reconnect to replay (s).
DEFAULT_RETENTION = 600.0
#: At most this many finished jobs are kept.
DEFAULT_MAX_FINISHED = 1000


@dataclass
class _Entry:
    chunks: list[pb.TokenChunk] = field(default_factory=list)
    result: pb.JobResult | None = None
    finished_at: float = 0.0


class JobJournal:
    def __init__(
        self,
        *,
        retention: float = DEFAULT_RETENTION,
        max_finished: int = DEFAULT_MAX_FINISHED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retention = retention
        self.max_finished = max_finished
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._finished: OrderedDict[str, float] = OrderedDict()

    def record_chunk(self, chunk: pb.TokenChunk) -> None:
        entry = self._entries.get(chunk.job_id)
        if entry is None:
            entry = self._entries[chunk.job_id] = _Entry()
        entry.chunks.append(chunk)

    def record_result(self, result: pb.JobResult) -> None:
        entry = self._entries.get(result.job_id)
        if entry is None:
            entry = self._entries[result.job_id] = _Entry()
        now = self.clock()
        entry.result, entry.finished_at = result, now
        self._finished[result.job_id] = now
        self._finished.move_to_end(result.job_id)
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._finished:
            job_id, finished_at = next(iter(self._finished.items()))
            if len(self._finished) <= self.max_finished and now - finished_at <= self.retention:
                break
            self.forget(job_id)

    def forget(self, job_id: str) -> None:
        self._entries.pop(job_id, None)
        self._finished.pop(job_id, None)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        """Drops every job not in ``job_ids`` (the controller no longer waits for it)."""
        keep = set(job_ids)
        for job_id in [j for j in self._entries if j not in keep]:
            self.forget(job_id)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._entries

    def jobs(self) -> list[str]:
        return list(self._entries)

    def finished(self, job_id: str) -> bool:
        entry = self._entries.get(job_id)
        return entry is not None and entry.result is not None

    def replay(self, job_id: str, next_seq: int) -> list[pb.AgentMessage]:
        """The messages the controller lacks of ``job_id``: every delta from ``next_seq`` on
        (whole chunks where they can be, cut where one straddles it), then the result."""
        entry = self._entries.get(job_id)
        if entry is None:
            return []
        out: list[pb.AgentMessage] = []
        for chunk in entry.chunks:
            deltas = chunk.deltas
            if not deltas or deltas[-1].seq < next_seq:
                continue
            if deltas[0].seq >= next_seq:
                out.append(pb.AgentMessage(token_chunk=chunk))
            else:
                kept = [d for d in deltas if d.seq >= next_seq]
                out.append(pb.AgentMessage(token_chunk=pb.TokenChunk(job_id=job_id, deltas=kept)))
        if entry.result is not None:
            out.append(pb.AgentMessage(job_result=entry.result))
        return out
