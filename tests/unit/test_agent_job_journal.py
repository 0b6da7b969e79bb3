"""The agent's job journal: what it replays after a reconnect, and what it forgets."""

from __future__ import annotations

from agent.control.job_journal import JobJournal
from wire import control_pb2 as pb


def chunk(job: str, *seqs: int) -> pb.TokenChunk:
    return pb.TokenChunk(job_id=job, deltas=[pb.Delta(seq=s, text=f"t{s}", tokens=1) for s in seqs])


def result(job: str) -> pb.JobResult:
    return pb.JobResult(job_id=job, ok=True, finish_reason="stop")


def seqs(messages: list[pb.AgentMessage]) -> list[int | str]:
    out: list[int | str] = []
    for m in messages:
        if m.WhichOneof("payload") == "token_chunk":
            out.extend(d.seq for d in m.token_chunk.deltas)
        else:
            out.append(m.WhichOneof("payload") or "")
    return out


def test_replay_starts_at_the_first_missing_token_and_ends_with_the_result() -> None:
    journal = JobJournal()
    for c in (chunk("j", 0, 1), chunk("j", 2, 3, 4), chunk("j", 5)):
        journal.record_chunk(c)
    assert seqs(journal.replay("j", 0)) == [0, 1, 2, 3, 4, 5]
    assert seqs(journal.replay("j", 3)) == [3, 4, 5]  # a chunk cut where it straddles
    assert seqs(journal.replay("j", 6)) == []
    journal.record_result(result("j"))
    assert seqs(journal.replay("j", 6)) == ["job_result"]
    assert seqs(journal.replay("j", 5)) == [5, "job_result"]
    assert journal.replay("other", 0) == []


def test_jobs_the_controller_no_longer_waits_for_are_forgotten() -> None:
    journal = JobJournal()
    journal.record_chunk(chunk("a", 0))
    journal.record_chunk(chunk("b", 0))
    journal.keep_only(["b"])
    assert journal.jobs() == ["b"]


def test_finished_jobs_are_kept_for_the_retention_and_up_to_a_count() -> None:
    now = [0.0]
    journal = JobJournal(retention=10.0, max_finished=2, clock=lambda: now[0])
    journal.record_result(result("old"))
    now[0] = 5.0
    journal.record_result(result("mid"))
    journal.record_chunk(chunk("running", 0))
    now[0] = 11.0
    journal.record_result(result("new"))  # "old" is past its retention
    assert set(journal.jobs()) == {"mid", "new", "running"}
    now[0] = 12.0
    journal.record_result(result("newest"))  # three finished: one too many
    assert set(journal.jobs()) == {"new", "newest", "running"}
    assert journal.finished("new") and not journal.finished("running")
