"""A job whose setup ends while the event store is down (issue 21, finding 7): its ending is
retried until the store takes it, so the job is recorded as ended and its node's slot comes free
again once PostgreSQL is back, without a controller restart.

A real controller on a private PostgreSQL cluster (``initdb`` + ``pg_ctl``, tests/faults) and a
fake agent over the real protocol and TLS that holds the model on ONE slot and answers its
setup only when the test says: PostgreSQL is stopped while the job waits for that answer. The
answer is a setup failure (the re-plan cannot be recorded) or a validated setup (its
validation cannot be recorded); either way, before the fix, the ending was tried once, logged
and dropped: the job stayed DISPATCHED holding the node's only slot until a restart, and every
later request for the model waited for it in vain.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import pytest

from interfaces.controller_main import RunningController
from tests.controller_fixture import controller_fixture
from tests.faults.services import OwnPostgres
from tests.faults.streams import ask, serving_model_m
from tests.faults.waiting import until
from tests.integration.control_client import control_target
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token
from wire import control_pb2 as pb

pytestmark = pytest.mark.timeout(120)

SHA = "cd" * 32
#: After the store is back, the ending must be recorded and the slot free within this.
RECOVERY = 10.0


class SetupOnCue(FakeAgent):
    """A fake agent that answers an execution plan only once ``answer`` is set (with a
    failure when ``fail_setup`` is set then)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answer = asyncio.Event()
        self.planned = asyncio.Event()
        self.job_ids: list[str] = []

    async def _handle(self, message: pb.ControllerMessage) -> None:
        if message.WhichOneof("payload") == "execution_plan":
            self.job_ids.append(message.execution_plan.job_id)
            self.planned.set()
            await self.answer.wait()
        await super()._handle(message)


ctl = controller_fixture(
    own="postgres",
    queue_timeout=30.0,
    # A node silent for long is not what this test is about: heartbeats go on anyway.
    offline_after=30.0,
    degraded_after=15.0,
)


@pytest.fixture
async def agent(ctl: RunningController) -> AsyncIterator[SetupOnCue]:
    started = SetupOnCue(control_target(ctl), token(), "one-slot", holds=SHA, memory=4 << 30)
    await started.start()
    await serving_model_m(ctl, started)
    yield started
    await started.stop()


def _job_state(ctl: RunningController, job_id: str) -> str:
    return str(ctl.services.app.repository.get(UUID(job_id)).state)


def _slot_free(ctl: RunningController, node_id: str) -> bool:
    return not ctl.services.app.repository.get(UUID(node_id)).jobs


@pytest.mark.parametrize("answer", ["setup-failed", "setup-validated"])
async def test_a_setup_that_ends_during_a_store_outage_is_ended_once_the_store_is_back(
    ctl: RunningController, agent: SetupOnCue, own_postgres: OwnPostgres, answer: str
) -> None:
    request = asyncio.ensure_future(ask(ctl, timeout=60))
    await asyncio.wait_for(agent.planned.wait(), 20)  # JOB_DISPATCHED is recorded
    [job_id] = agent.job_ids
    own_postgres.stop()
    if answer == "setup-failed":
        agent.fail_setup = pb.SetupResult(
            ok=False, error="no such file", error_code="MODEL_NOT_FOUND", role="primary"
        )
    agent.answer.set()
    response = await asyncio.wait_for(request, 30)  # the client hears at once
    assert response.status_code >= 500, response.text
    await asyncio.sleep(1.0)  # the outage goes on a while: the ending must wait for it

    own_postgres.start()
    back_at = time.monotonic()
    try:
        took = await until(lambda: _job_state(ctl, job_id) in ("FAILED", "CANCELLED"), RECOVERY)
    except AssertionError:
        node: Any = ctl.services.app.repository.get(UUID(agent.node_id))
        raise AssertionError(
            f"the job is still {_job_state(ctl, job_id)} {RECOVERY:g}s after the store was "
            f"back, holding {sorted(node.jobs)} on its one-slot node"
        ) from None
    print(f"{answer}: the ending was recorded {took:.2f}s after the store was back")
    await until(lambda: _slot_free(ctl, agent.node_id), RECOVERY)
    # The node's only slot serves the next request, without a controller restart.
    agent.fail_setup = None
    while True:
        r = await ask(ctl, timeout=60)
        if r.status_code == 200:
            break
        assert time.monotonic() - back_at < RECOVERY, f"still {r.status_code}: {r.text}"
        await asyncio.sleep(0.2)
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"
