"""Fuzzes the controller's own OpenAPI schema against a real controller (Postgres, Redis).

Schemathesis draws requests for every operation ``/schema/openapi.json`` documents, valid and
invalid ones, with the right bearer key, without one and with a wrong one, and checks each
response (:mod:`tests.integration.api_fuzz`): no 5xx except a 503 with ``Retry-After`` (busy:
no capacity, queue full, store outage), a documented status code and content type, a body
matching the documented schema, invalid data refused with a 4xx and valid data accepted,
keys enforced.

One fake agent is enrolled, without the model's file, and one model registered: a chat
completion for it is refused at once with ``503 no_capacity`` (nothing waits in the admission
queue, whose timeout is also short), and that refusal leaves a failed job. Valid cases name
that node, job and model half the time, so success answers are checked as well as 404s. The
event feed (an endless SSE stream) is read up to its first event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from interfaces.controller_main import RunningController
from tests.controller_fixture import controller_fixture
from tests.integration.api_fuzz import ADMIN_KEY, AI_KEY, Budget, FuzzReport, Known, fuzz
from tests.integration.control_client import control_target
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token

#: At least this many cases must run, or generation shrank without anyone noticing.
MIN_CASES = 1000
#: Examples per operation, data mode and key (see :class:`Budget`): about 1,700 cases, 25-35 s
#: on two cores. The operations without input give one case each: their input space is empty.
BUDGET = Budget(valid=60, rejected=8)
MODEL = "fuzz-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


# No agent holds the model: no capacity, so admission refuses at once. The queue
# settings are a second line: a request that did queue would give up within a second.
ctl = controller_fixture(queue_timeout=1.0, queue_max=2)


@pytest.fixture
async def agent(ctl: RunningController) -> AsyncIterator[FakeAgent]:
    """A connected node that holds no model file."""
    started = await FakeAgent(control_target(ctl), token(), "fuzz-node").start()
    yield started
    await started.stop()


async def seed(client: httpx.AsyncClient, agent: FakeAgent) -> Known:
    """A connected node, a registered model and a failed job: real things to name."""
    registered = await client.post(
        "/api/admin/models",
        headers=ADMIN,
        json={"name": MODEL, "sha256": "ab" * 32, "file_name": "fuzz.gguf"},
    )
    assert registered.status_code == 201, registered.text
    refused = await client.post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {AI_KEY}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    deadline = time.monotonic() + 10
    while True:
        jobs = (await client.get("/api/admin/jobs", headers=ADMIN)).json()["data"]
        node = (await client.get(f"/api/admin/nodes/{agent.node_id}", headers=ADMIN)).status_code
        if jobs and node == 200:
            break
        assert time.monotonic() < deadline, (jobs, node)
        await asyncio.sleep(0.05)
    return {"node_id": [agent.node_id], "job_id": [jobs[0]["job_id"]], "model": [MODEL]}


async def test_fuzz_every_documented_operation(ctl: RunningController, agent: FakeAgent) -> None:
    base_url = f"http://127.0.0.1:{ctl.http_port}"
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        known = await seed(client, agent)

        # Schemathesis is synchronous: it runs in a thread of its own while this loop serves.
        with ThreadPoolExecutor(1, thread_name_prefix="fuzz") as pool:
            report: FuzzReport = await asyncio.get_running_loop().run_in_executor(
                pool, fuzz, base_url, BUDGET, known
            )
        print(report.summary())
        assert not report.failures, "\n\n".join(f"{k}\n{v}" for k, v in report.failures.items())
        assert report.total >= MIN_CASES, report.summary()

        # The fuzzing left the controller healthy: no poisoned view, no tripped store guard.
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
