"""BackgroundTasks keeps its tasks until they end, logs failures, and can be waited for."""

from __future__ import annotations

import asyncio
import logging

import pytest

from application.background import BackgroundTasks


async def test_failures_are_logged_and_settle_waits_for_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = BackgroundTasks("handling a test message")
    gate = asyncio.Event()
    done: list[str] = []

    async def waits() -> None:
        await gate.wait()
        done.append("waited")
        tasks.spawn(then())  # spawned while settling: waited for too

    async def then() -> None:
        done.append("then")

    async def fails() -> None:
        raise RuntimeError("the store went away")

    tasks.spawn(waits())
    tasks.spawn(fails())
    assert len(tasks) == 2
    settling = asyncio.ensure_future(tasks.settle())
    await asyncio.sleep(0)
    assert not settling.done()
    gate.set()
    await asyncio.wait_for(settling, 5)
    assert done == ["waited", "then"] and len(tasks) == 0
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in failures] == ["handling a test message failed"]
