"""merge_token_chunks: the agent's write loop merges only adjacent TokenChunks of one job."""

from __future__ import annotations

from agent.control.token_merge import MAX_MERGED_DELTAS, MAX_MERGED_TEXT, merge_token_chunks
from wire import control_pb2 as pb


def chunk(job_id: str, *texts: str, seq: int = 0) -> pb.AgentMessage:
    deltas = [pb.Delta(seq=seq + n, text=text, tokens=1) for n, text in enumerate(texts)]
    return pb.AgentMessage(token_chunk=pb.TokenChunk(job_id=job_id, deltas=deltas))


def summary(messages: list[pb.AgentMessage]) -> list[tuple[str, str, list[tuple[int, str]]]]:
    out = []
    for message in messages:
        kind = str(message.WhichOneof("payload"))
        if kind == "token_chunk":
            c = message.token_chunk
            out.append((kind, c.job_id, [(d.seq, d.text) for d in c.deltas]))
        else:
            out.append((kind, getattr(message, kind).job_id if kind != "heartbeat" else "", []))
    return out


def test_merging_preserves_order_across_jobs_and_kinds() -> None:
    messages = [
        chunk("a", "a0", seq=0),
        chunk("a", "a1", "a2", seq=1),
        chunk("b", "b0", seq=0),  # another job: a new chunk, never merged into a's
        chunk("a", "a3", seq=3),
        pb.AgentMessage(heartbeat=pb.Heartbeat()),  # another kind: a barrier
        chunk("a", "a4", seq=4),
        chunk("a", "a5", seq=5),
        pb.AgentMessage(job_result=pb.JobResult(job_id="a", ok=True)),
        chunk("b", "b1", seq=1),
        chunk("b", "b2", seq=2),
        pb.AgentMessage(setup_result=pb.SetupResult(job_id="c", ok=True)),
    ]
    before = [m.SerializeToString() for m in messages]

    merged = merge_token_chunks(messages)

    assert summary(merged) == [
        ("token_chunk", "a", [(0, "a0"), (1, "a1"), (2, "a2")]),
        ("token_chunk", "b", [(0, "b0")]),
        ("token_chunk", "a", [(3, "a3")]),
        ("heartbeat", "", []),
        ("token_chunk", "a", [(4, "a4"), (5, "a5")]),
        ("job_result", "a", []),
        ("token_chunk", "b", [(1, "b1"), (2, "b2")]),
        ("setup_result", "c", []),
    ]
    # Every delta of every job is there exactly once, in order; the inputs are untouched.
    for job in ("a", "b"):
        seqs = [d.seq for m in merged if m.token_chunk.job_id == job for d in m.token_chunk.deltas]
        assert seqs == list(range(len(seqs)))
    assert [m.SerializeToString() for m in messages] == before


def test_nothing_to_merge_returns_the_same_messages() -> None:
    messages = [chunk("a", "x"), pb.AgentMessage(heartbeat=pb.Heartbeat()), chunk("a", "y")]
    merged = merge_token_chunks(messages)
    assert all(m is n for m, n in zip(merged, messages, strict=True))
    assert merge_token_chunks([]) == []


def test_merged_chunks_are_bounded() -> None:
    many = [chunk("a", "x", seq=n) for n in range(MAX_MERGED_DELTAS + 10)]
    sizes = [len(m.token_chunk.deltas) for m in merge_token_chunks(many)]
    assert sizes == [MAX_MERGED_DELTAS, 10]

    big = "y" * (MAX_MERGED_TEXT // 2)
    merged = merge_token_chunks([chunk("a", big, seq=n) for n in range(3)])
    assert [len(m.token_chunk.deltas) for m in merged] == [2, 1]
    assert [d.seq for m in merged for d in m.token_chunk.deltas] == [0, 1, 2]
