"""LlamaHandler logic that needs no llama.cpp process: chunking, stats, plan validation, refusals.

The real runtime paths (streaming, RPC split, warm reuse, cancel) are covered end to end in
tests/e2e/test_agent_llama_handler.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession
from agent.control.control_handler import NullHandler
from agent.control.job_traffic import Connection
from agent.runtime import llama_server
from agent.runtime.job_messages import (
    GENERATION_FAILED,
    INVALID_PLAN,
    MODEL_NOT_FOUND,
    SHA256_MISMATCH,
    DeltaSender,
    SetupFailure,
    generation_stats,
    parse_messages,
)
from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.llama_handler import LlamaHandler, _Job
from agent.runtime.llama_server import ChatDelta, ChatRequest, LlamaServer
from agent.runtime.runtime import RuntimeManager
from tests.unit.test_runtime_paths import FINAL_CHUNK
from wire import control_pb2 as pb


class Collect:
    def __init__(self) -> None:
        self.sent: list[pb.AgentMessage] = []

    async def __call__(self, message: pb.AgentMessage) -> None:
        self.sent.append(message)


class GatedCall:
    """The session's gRPC call: ``write`` blocks until ``gate`` is set, recording what it got."""

    def __init__(self) -> None:
        self.written: list[pb.AgentMessage] = []
        self.gate = asyncio.Event()
        self.writing = asyncio.Event()

    async def write(self, message: pb.AgentMessage) -> None:
        self.writing.set()
        await self.gate.wait()
        self.written.append(message)

    def done(self) -> bool:
        return False


def chunks(messages: list[pb.AgentMessage]) -> list[list[tuple[int, str, int]]]:
    return [[(d.seq, d.text, d.tokens) for d in m.token_chunk.deltas] for m in messages]


async def test_delta_sender_sends_each_piece_at_once_numbered_from_zero() -> None:
    send = Collect()
    sender = DeltaSender("j", send, interval=0.0)
    await sender.push("a")
    assert chunks(send.sent) == [[(0, "a", 1)]]
    await sender.push("b")
    await sender.push("c", tokens=2)
    assert chunks(send.sent) == [[(0, "a", 1)], [(1, "b", 1)], [(2, "c", 2)]]
    assert all(m.token_chunk.job_id == "j" for m in send.sent)
    assert sender.next_seq == 3


async def test_pieces_after_the_first_go_together_at_most_every_interval() -> None:
    """The first piece at once; those within the interval of the last chunk wait and go as
    one chunk (flush, or the flusher when the interval is up); one after it goes at once.
    The clock and the flusher's sleep are the test's: no time passes."""
    now = [0.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(round(seconds, 6))

    send = Collect()
    sender = DeltaSender("j", send, interval=0.025, clock=lambda: now[0], sleep=sleep)
    await sender.push("a")  # t=0: at once
    now[0] = 0.010
    await sender.push("b")
    await sender.push("c", tokens=2)
    assert chunks(send.sent) == [[(0, "a", 1)]]  # b and c wait
    await sender.flush()  # the job's result comes next
    assert chunks(send.sent) == [[(0, "a", 1)], [(1, "b", 1), (2, "c", 2)]]
    now[0] = 0.040  # the interval since the last chunk is up: at once
    await sender.push("d")
    assert chunks(send.sent)[-1] == [(3, "d", 1)]
    now[0] = 0.050
    await sender.push("e")  # waits; the flusher sleeps what is left of the interval
    await sender.push("f")
    for _ in range(3):
        await asyncio.sleep(0)  # the flusher runs
    assert slept == [0.015]
    assert chunks(send.sent)[-1] == [(4, "e", 1), (5, "f", 1)]
    now[0] = 0.060
    await sender.push("g")
    sender.discard()  # cancelled: g is never sent
    await sender.flush()
    assert chunks(send.sent)[-1] == [(4, "e", 1), (5, "f", 1)] and sender.next_seq == 7


async def test_pieces_queued_behind_a_pending_write_go_out_as_one_chunk(tmp_path: Path) -> None:
    """DeltaSender -> JobTraffic.send -> the session's write loop, as in production."""
    session = AgentSession(AgentConfig(data_dir=tmp_path, node_name="n"), NullHandler())
    call = GatedCall()
    conn = Connection(call)  # type: ignore[arg-type]
    session.traffic.conn = conn
    writer = asyncio.create_task(session._write_loop(conn))
    try:
        sender = DeltaSender("j", session.traffic.send, interval=0.0)
        await sender.push("a")
        await asyncio.wait_for(call.writing.wait(), 5)  # "a" is being written (and blocks)
        for text in "bcd":
            await sender.push(text)
        await session.traffic.send(pb.AgentMessage(job_result=pb.JobResult(job_id="j", ok=True)))
        call.gate.set()
        while len(call.written) < 3:
            await asyncio.sleep(0)
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
    kinds = [m.WhichOneof("payload") for m in call.written]
    assert kinds == ["token_chunk", "token_chunk", "job_result"]
    assert chunks(call.written[:2]) == [[(0, "a", 1)], [(1, "b", 1), (2, "c", 1), (3, "d", 1)]]
    assert conn.queue.empty()


def test_stats_prefer_llama_server_numbers() -> None:
    stats = generation_stats(
        started=0.0,
        first_piece=0.5,
        last_piece=1.5,
        pieces=11,
        usage_prompt_tokens=20,
        usage_completion_tokens=10,
        timings_prompt_tokens=20,
        timings_prompt_ms=40.0,
        timings_predicted_tokens=10,
        timings_predicted_ms=100.0,
    )
    assert (stats.prompt_tokens, stats.completion_tokens) == (20, 10)
    assert stats.time_to_first_token_ms == 40.0
    assert stats.tokens_per_second == pytest.approx(100.0)


def test_cached_prompt_tokens_come_from_usage_else_from_timings() -> None:
    both = generation_stats(
        started=0.0,
        first_piece=None,
        last_piece=None,
        pieces=0,
        usage_cached_tokens=1536,
        timings_cached_tokens=1500,
    )
    assert both.cached_prompt_tokens == 1536
    timings_only = generation_stats(
        started=0.0, first_piece=None, last_piece=None, pieces=0, timings_cached_tokens=12
    )
    assert timings_only.cached_prompt_tokens == 12
    neither = generation_stats(started=0.0, first_piece=None, last_piece=None, pieces=0)
    assert neither.cached_prompt_tokens == 0


def test_stats_are_measured_when_llama_server_sends_none() -> None:
    stats = generation_stats(started=1.0, first_piece=1.25, last_piece=3.25, pieces=5)
    assert (stats.prompt_tokens, stats.completion_tokens) == (0, 5)
    assert stats.time_to_first_token_ms == pytest.approx(250.0)
    assert stats.tokens_per_second == pytest.approx(2.0)  # 4 pieces after the first in 2 s
    empty = generation_stats(started=1.0, first_piece=None, last_piece=None, pieces=0)
    assert (empty.completion_tokens, empty.time_to_first_token_ms, empty.tokens_per_second) == (
        0,
        0.0,
        0.0,
    )


@pytest.mark.parametrize("text", ["", "not json", "{}", "[]", "[1, 2]"])
def test_bad_messages_are_an_invalid_plan(text: str) -> None:
    with pytest.raises(SetupFailure) as caught:
        parse_messages(text)
    assert caught.value.error_code == INVALID_PLAN


def test_messages_are_parsed() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert parse_messages(json.dumps(messages)) == messages


# --- handler without processes -----------------------------------------------------------


@pytest.fixture
async def handler(tmp_path: Path) -> AsyncIterator[LlamaHandler]:
    fake = tmp_path / "bin"  # never executed by these tests
    binaries = RuntimeBinaries(fake, fake / "llama-server", fake / "ggml-rpc-server")
    (tmp_path / "models").mkdir()
    h = LlamaHandler(
        binaries, models_dir=tmp_path / "models", data_dir=tmp_path, log_dir=tmp_path / "logs"
    )
    yield h
    await h.close()


def plan(job_id: str, file_name: str = "m.gguf", messages: str = '[{"role":"user","content":"x"}]'):
    return pb.ExecutionPlan(
        job_id=job_id,
        role=pb.ExecutionPlan.PRIMARY,
        model_file_name=file_name,
        model_sha256="a" * 64,
        generation=pb.GenerationParams(max_tokens=4),
        chat=pb.ChatJob(messages_json=messages),
    )


def only_setup_result(sent: Collect) -> pb.SetupResult:
    assert [m.WhichOneof("payload") for m in sent.sent] == ["setup_result"]
    return sent.sent[0].setup_result


async def test_missing_model_is_refused(handler: LlamaHandler) -> None:
    sent = Collect()
    await handler.on_plan(plan("j1", file_name="absent.gguf"), sent)
    result = only_setup_result(sent)
    assert (result.ok, result.error_code, result.role) == (False, MODEL_NOT_FOUND, "primary")
    assert "absent.gguf" in result.error
    assert handler.active_job_ids() == []


async def test_path_traversal_is_not_found(handler: LlamaHandler, tmp_path: Path) -> None:
    (tmp_path / "outside.gguf").write_bytes(b"x")
    sent = Collect()
    await handler.on_plan(plan("j1", file_name="../outside.gguf"), sent)
    assert only_setup_result(sent).error_code == MODEL_NOT_FOUND


async def test_unverifiable_model_is_a_sha256_mismatch(
    handler: LlamaHandler, tmp_path: Path
) -> None:
    (tmp_path / "models" / "m.gguf").write_bytes(b"not a gguf file")
    sent = Collect()
    await handler.on_plan(plan("j1"), sent)
    result = only_setup_result(sent)
    assert result.error_code == SHA256_MISMATCH and "a" * 64 in result.error


async def test_bad_messages_are_refused_before_anything_else(handler: LlamaHandler) -> None:
    sent = Collect()
    await handler.on_plan(plan("j1", messages="nope"), sent)
    assert only_setup_result(sent).error_code == INVALID_PLAN


@pytest.mark.parametrize("host", ["0.0.0.0", "8.8.8.8", "::", "not-an-ip"])
async def test_unsafe_rpc_bind_is_refused(handler: LlamaHandler, host: str) -> None:
    sent = Collect()
    await handler.on_start_rpc_worker(pb.StartRpcWorker(job_id="j", host=host, port=50052), sent)
    [message] = sent.sent
    status = message.rpc_worker_status
    assert (status.job_id, status.state, status.host) == ("j", pb.RpcWorkerStatus.FAILED, host)
    assert status.error
    assert handler.runtime.rpc_workers == {}


async def test_worker_plans_cancels_and_stops_need_no_process(handler: LlamaHandler) -> None:
    sent = Collect()
    worker_plan = pb.ExecutionPlan(job_id="j", role=pb.ExecutionPlan.WORKER)
    await handler.on_plan(worker_plan, sent)
    await handler.on_cancel(pb.CancelJob(job_id="unknown"), sent)
    assert sent.sent == []
    await handler.on_stop_rpc_worker(pb.StopRpcWorker(job_id="j"), sent)
    [message] = sent.sent
    assert message.rpc_worker_status.state == pb.RpcWorkerStatus.STOPPED


async def test_closed_handler_refuses_plans(handler: LlamaHandler) -> None:
    await handler.close()
    await handler.close()  # idempotent
    sent = Collect()
    await handler.on_plan(plan("j1"), sent)
    result = only_setup_result(sent)
    assert (result.ok, result.error_code) == (False, "AGENT_STOPPING")


class StreamingServer:
    """A warm llama-server stand-in whose stream is the given SSE lines, parsed as the real one."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    async def stream_chat(self, request: ChatRequest) -> AsyncIterator[ChatDelta]:
        for line in self.lines:
            delta = llama_server._parse_sse_line(line)
            if isinstance(delta, ChatDelta):
                yield delta


async def test_job_result_carries_the_cached_prompt_tokens(handler: LlamaHandler) -> None:
    content = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    lines = [b"data: " + json.dumps(content).encode(), b"data: " + json.dumps(finish).encode()]
    server = StreamingServer([*lines, FINAL_CHUNK])
    sent = Collect()
    request = ChatRequest(messages=[{"role": "user", "content": "x"}])
    await handler._execute(_Job("j"), cast(LlamaServer, server), request, sent)
    result = sent.sent[-1].job_result
    assert (result.job_id, result.ok, result.finish_reason) == ("j", True, "stop")
    assert (result.prompt_tokens, result.cached_prompt_tokens) == (1600, 1536)


class StoppableRuntime:
    """The runtime manager's server slot: a server stand-in and the stops asked for."""

    def __init__(self) -> None:
        self.server: object | None = object()
        self.stops = 0

    def stop_server(self) -> None:
        self.stops += 1
        self.server = None

    def close(self) -> None:
        pass


async def test_stop_server_stops_an_idle_server_and_keeps_one_a_job_uses(
    handler: LlamaHandler,
) -> None:
    runtime = StoppableRuntime()
    handler.runtime = cast(RuntimeManager, runtime)
    handler._server_users = 1  # a job set up after the retirement uses it
    await handler.on_stop_server(pb.StopServer(reason="idle for 900 s"))
    assert (runtime.stops, runtime.server is not None) == (0, True)
    handler._server_users = 0
    await handler.on_stop_server(pb.StopServer(reason="idle for 900 s"))
    assert (runtime.stops, runtime.server) == (1, None)
    await handler.on_stop_server(pb.StopServer(reason="again"))  # nothing left to stop
    assert runtime.stops == 1 and handler._stopping is None


class FaultyServer:
    """A warm llama-server stand-in whose stream gives one piece and then meets a fault of
    the agent's own (a bug, not a llama.cpp failure)."""

    async def stream_chat(self, request: ChatRequest) -> AsyncIterator[ChatDelta]:
        yield ChatDelta(text="a")
        raise TypeError("a bug of the agent's own")


async def test_a_fault_of_the_agent_after_setup_fails_the_job_at_once(
    handler: LlamaHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = ChatRequest(messages=[{"role": "user", "content": "x"}])

    async def warm_setup(plan: pb.ExecutionPlan) -> tuple[LlamaServer, ChatRequest]:
        return cast(LlamaServer, FaultyServer()), request

    monkeypatch.setattr(handler, "_setup", warm_setup)
    sent = Collect()
    await handler._run_primary(_Job("j"), plan("j"), sent)
    kinds = [m.WhichOneof("payload") for m in sent.sent]
    assert kinds == ["setup_result", "token_chunk", "job_result"]
    result = sent.sent[-1].job_result
    assert not result.ok and result.error_code == GENERATION_FAILED
    assert "TypeError: a bug of the agent's own" in result.error
