"""The controller's graceful stop (interfaces/controller_shutdown.py) on a real controller
(Postgres, Redis, gRPC) with a FakeAgent streaming: it logs what it waits for, lets a job that
ends in time finish, and ends one that outlasts the bound, its client told. The real process's
SIGTERM and exit status: tests/e2e/test_graceful_stop.py."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from application.job_manager import CONTROLLER_STOPPING
from interfaces.controller_main import RunningController
from interfaces.controller_shutdown import StopSignals, drain_controller
from tests.integration.test_job_flow import chat_stream, ctl, slow_primary, synced

__all__ = ["ctl"]  # the fixture


async def _stream_then_stop(
    ctl: RunningController, timeout: float, words: int
) -> tuple[list[str], float]:
    """Streams one completion; after its first lines, SIGTERM (as the handler sees it) and the
    stop; returns the lines the client got and how long the stop took (s)."""
    await slow_primary(ctl, words)
    signals = StopSignals()
    draining: asyncio.Task[None] | None = None
    lines: list[str] = []
    started = 0.0
    async with chat_stream(ctl) as r:
        async for line in r.aiter_lines():
            lines.append(line)
            if len(lines) == 4:
                signals.received("SIGTERM")
                started = time.monotonic()
                draining = asyncio.create_task(drain_controller(ctl, timeout, signals))
    assert draining is not None
    await asyncio.wait_for(draining, timeout + 20)
    return lines, time.monotonic() - started


async def test_a_job_that_ends_in_time_finishes_and_the_wait_is_logged(
    ctl: RunningController, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "interfaces.controller_shutdown")
    lines, took = await _stream_then_stop(ctl, 30.0, words=20)
    assert took < 15  # the job's end, not the bound
    assert "data: [DONE]" in lines and not [line for line in lines if '"error"' in line]
    [row] = synced(ctl).services.read_model.list_jobs()
    assert row["state"] == "COMPLETED"
    assert (
        "SIGTERM: stopping: no new requests; waiting for 1 running job(s) on 1 open HTTP "
        "connection(s), at most 30 s (SHUTDOWN_TIMEOUT)"
    ) in caplog.text
    assert "stopping: every request ended after" in caplog.text
    assert ctl.tasks[0].done()  # the HTTP server took no more requests and ended


async def test_a_job_that_outlasts_shutdown_timeout_is_ended_and_its_client_told(
    ctl: RunningController, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "interfaces.controller_shutdown")
    lines, _ = await _stream_then_stop(ctl, 0.2, words=2000)  # 40 s of tokens
    errors = [line for line in lines if '"error"' in line]
    assert errors and "SHUTDOWN_TIMEOUT (0.2 s)" in errors[0]
    [row] = synced(ctl).services.read_model.list_jobs()
    assert (row["state"], row["error_code"]) == ("FAILED", CONTROLLER_STOPPING)
    assert "ended 1 running job(s)" in caplog.text


async def test_a_second_signal_ends_the_wait_at_once(
    ctl: RunningController, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "interfaces.controller_shutdown")
    await slow_primary(ctl, 2000)
    signals = StopSignals()
    lines: list[str] = []
    async with chat_stream(ctl) as r:
        async for line in r.aiter_lines():
            lines.append(line)
            if len(lines) == 4:
                signals.received("SIGTERM")
                draining = asyncio.create_task(drain_controller(ctl, 300.0, signals))
                await asyncio.sleep(0)
                signals.received("SIGTERM")
    await asyncio.wait_for(draining, 20)
    errors = [line for line in lines if '"error"' in line]
    assert errors and "a second signal" in errors[0]
    assert "SIGTERM again: no more waiting for running jobs" in caplog.text
