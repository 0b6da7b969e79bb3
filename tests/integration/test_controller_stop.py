"""A controller's stop is bounded: a background task that ignores its cancellation is named in
the log and left behind, instead of holding the controller's exit (and its tests) forever."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from interfaces import controller_main
from interfaces.controller_main import start_controller, stop_controller
from tests.conftest import controller_settings


async def _stubborn(released: asyncio.Event) -> None:
    while not released.is_set():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue  # the bug this guards against: a loop that swallows its cancellation


async def test_a_task_that_ignores_cancellation_does_not_hold_the_stop(
    pg_schema: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(controller_main, "STOP_TASKS_TIMEOUT", 0.5)
    running = await start_controller(controller_settings(pg_schema, tmp_path))
    released = asyncio.Event()
    stubborn = asyncio.create_task(_stubborn(released), name="stubborn")
    running.tasks.append(stubborn)
    try:
        started = time.monotonic()
        await asyncio.wait_for(stop_controller(running), timeout=20)
        assert time.monotonic() - started < 10
        logged = capfd.readouterr().err
        assert "task stubborn did not stop within 0.5 s" in logged
        assert "_stubborn" in logged  # where it waits
        assert all(t.done() for t in running.tasks if t is not stubborn)
    finally:
        released.set()
        stubborn.cancel()
        await asyncio.wait({stubborn}, timeout=5)
