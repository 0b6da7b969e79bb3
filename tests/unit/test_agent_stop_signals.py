"""The agent's stop signals (:meth:`AgentSession.on_signal`): the first drains (Stopping to the
controller, new work refused, Goodbye once the jobs end or the drain times out), a second one
stops at once with exit status 128 + its number. No controller: the session's stream is a fake
connection whose queue the test reads."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from agent import agent_stop
from agent.agent_config import DEFAULT_DRAIN_TIMEOUT, AgentConfig
from agent.control.control_client import AgentSession
from agent.control.control_handler import NullHandler
from agent.control.job_traffic import Connection
from agent.main import build_parser, config_from_args
from agent.runtime.job_messages import AGENT_STOPPING
from wire import control_pb2 as pb


class FakeJobsHandler(NullHandler):
    """A handler whose running jobs the test sets."""

    def __init__(self, jobs: list[str]) -> None:
        self.jobs = jobs

    def active_job_ids(self) -> list[str]:
        return list(self.jobs)


class FakeCall:
    """Stands for the gRPC call of a connection the test never writes to."""


@pytest.fixture(autouse=True)
def no_poll_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_stop, "DRAIN_POLL_INTERVAL", 0)


class Start(Protocol):
    def __call__(
        self, jobs: list[str], drain_timeout: float = 60.0
    ) -> tuple[AgentSession, FakeJobsHandler, Connection]: ...


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    """Makes a session running ``jobs`` on a fake connection; each is stopped after the test."""
    sessions: list[AgentSession] = []

    def start_(
        jobs: list[str], drain_timeout: float = 60.0
    ) -> tuple[AgentSession, FakeJobsHandler, Connection]:
        handler = FakeJobsHandler(jobs)
        config = AgentConfig(data_dir=tmp_path, node_name="n1", drain_timeout=drain_timeout)
        session = AgentSession(config, handler)
        conn = Connection(call=FakeCall())  # type: ignore[arg-type]
        session.traffic.conn = conn
        sessions.append(session)
        return session, handler, conn

    yield start_
    for session in sessions:
        await session.stop()


def queued(conn: Connection) -> list[pb.AgentMessage]:
    out = []
    while not conn.queue.empty():
        out.append(conn.queue.get_nowait())
    return out


async def test_the_first_signal_drains_refuses_new_work_and_stops_once_the_jobs_end(
    start: Start,
) -> None:
    session, handler, conn = start(["j1"])
    session.on_signal(signal.SIGINT)
    assert session.draining and session.exit_code == 0
    [stopping] = queued(conn)
    assert stopping.WhichOneof("payload") == "stopping"
    assert list(stopping.stopping.running_job_ids) == ["j1"]
    assert stopping.stopping.drain_timeout_seconds == 60.0
    # A plan on its way when the drain began is refused: the controller plans it elsewhere.
    plan = pb.ExecutionPlan(job_id="j2", role=pb.ExecutionPlan.PRIMARY)
    session.traffic.dispatch(pb.ControllerMessage(execution_plan=plan))
    worker = pb.StartRpcWorker(job_id="j3", host="127.0.0.1", port=50052)
    session.traffic.dispatch(pb.ControllerMessage(start_rpc_worker=worker))
    await asyncio.gather(*session.traffic.tasks)
    refused, failed = queued(conn)
    assert (refused.setup_result.job_id, refused.setup_result.ok) == ("j2", False)
    assert refused.setup_result.error_code == AGENT_STOPPING
    assert failed.rpc_worker_status.state == pb.RpcWorkerStatus.FAILED
    assert not session._stop_requested  # j1 still runs
    handler.jobs = []
    assert session.stop_signals.task is not None
    await session.stop_signals.task
    assert session._stop_requested
    assert session.stop_signals.goodbye_reason == "drained (1 job(s) finished)"
    assert session.exit_code == 0


async def test_a_second_signal_stops_at_once_with_a_non_zero_status(start: Start) -> None:
    session, _handler, _conn = start(["j1", "j2"])
    session.on_signal(signal.SIGTERM)
    assert not session._stop_requested
    session.on_signal(signal.SIGINT)
    assert session._stop_requested
    assert session.exit_code == 128 + signal.SIGINT
    assert session.stop_signals.goodbye_reason == (
        "stopped at once by a second signal (SIGINT) with 2 job(s) running"
    )


async def test_a_drain_that_times_out_says_so_and_exits_zero(start: Start) -> None:
    session, _handler, _conn = start(["j1"], drain_timeout=0.01)
    session.on_signal(signal.SIGTERM)
    assert session.stop_signals.task is not None
    await session.stop_signals.task  # the job never ends
    assert session._stop_requested and session.exit_code == 0
    assert (
        session.stop_signals.goodbye_reason
        == "its drain timed out after 0.01 s with 1 job(s) running"
    )


async def test_no_drain_timeout_stops_at_the_first_signal(start: Start) -> None:
    session, _handler, conn = start(["j1"], drain_timeout=0)
    session.on_signal(signal.SIGTERM)
    assert session._stop_requested and not session.draining and session.exit_code == 0
    assert (
        session.stop_signals.goodbye_reason
        == "stopped by SIGTERM without a drain (drain timeout 0)"
    )
    assert queued(conn) == []  # no Stopping: nothing to drain


def _parsed(argv: list[str], monkeypatch: pytest.MonkeyPatch, env: str | None = None) -> Any:
    if env is None:
        monkeypatch.delenv("DACP_DRAIN_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("DACP_DRAIN_TIMEOUT", env)
    return build_parser().parse_args(["--data-dir", "/tmp/x", *argv])


def test_the_drain_timeout_flag_its_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parsed([], monkeypatch).drain_timeout == DEFAULT_DRAIN_TIMEOUT == 60.0
    assert _parsed([], monkeypatch, env="5").drain_timeout == 5.0
    assert _parsed(["--drain-timeout", "0"], monkeypatch, env="5").drain_timeout == 0.0
    args = _parsed(["--drain-timeout", "2.5", "--controller-url", "127.0.0.1:1"], monkeypatch)
    assert config_from_args(args).drain_timeout == 2.5


@pytest.mark.parametrize("bad", ["-1", "soon"])
def test_a_bad_drain_timeout_is_exit_2_with_one_line(
    bad: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _parsed(["--drain-timeout", bad], monkeypatch)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--drain-timeout" in err
