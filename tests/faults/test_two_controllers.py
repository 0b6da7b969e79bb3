"""Two controller processes on one database: starting the second does not fail the first
one's jobs; a job whose controller is gone (its lease ran out) is failed by the survivor and
its slots come free.

Two controllers in this process on the shared PostgreSQL (one schema) and Redis (one key
prefix, where the leases live); a fake agent streams a slow job through the first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx

from application.commands import ChatPrompt, Submission
from domain.catalog import code_of
from interfaces.controller_main import RECONCILE_INTERVAL, RunningController, controller
from tests.conftest import controller_settings
from tests.faults.waiting import until
from tests.integration.control_client import control_target
from tests.integration.fake_agent import FakeAgent, register_model_m
from tests.integration.test_control_plane import token

SHA = "ab" * 32
AI = {"Authorization": "Bearer test-ai-key"}
WORDS = tuple(f" w{i}" for i in range(40))


def _codes(ctl: RunningController, job_id: str) -> list[str]:
    return [code_of(e) for e in ctl.services.app.repository.event_store.get(UUID(job_id))]


async def test_a_second_controller_leaves_the_first_ones_jobs_alone(
    pg_schema: str, tmp_path: Path
) -> None:
    async with controller(controller_settings(pg_schema, tmp_path / "a")) as first:
        agent = await FakeAgent(
            control_target(first), token(), "a", holds=SHA, memory=4 << 30
        ).start()
        agent.words, agent.word_delay = WORDS, 0.05
        base = f"http://127.0.0.1:{first.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            await register_model_m(client, SHA)
            await until(lambda: bool(first.services.read_model.eligibility()))
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            answer = asyncio.ensure_future(
                client.post("/v1/chat/completions", headers=AI, json=body)
            )
            await until(lambda: len(agent.plans) == 1)
            job_id = agent.plans[0].job_id

            async with controller(controller_settings(pg_schema, tmp_path / "b")) as second:
                r = await answer
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == "".join(WORDS)
                assert _codes(first, job_id)[-1] == "JOB_COMPLETED"

                # A job whose controller is gone: no lease under its owner's name.
                gone: Any = second.services.app
                owner, gone.owner = gone.owner, "a-controller-that-died"
                try:
                    orphan = gone.submit(
                        Submission("m", ChatPrompt([{"role": "user", "content": "x"}]))
                    ).aggregate_id
                finally:
                    gone.owner = owner
                assert orphan is not None
                took = await until(
                    lambda: _codes(second, str(orphan))[-1] == "JOB_FAILED",
                    RECONCILE_INTERVAL + 5,
                )
                failed: Any = list(
                    second.services.app.repository.event_store.get(UUID(str(orphan)))
                )[-1]
                assert failed.error_code == "controller_restarted"
                print(f"the dead controller's job failed {took:.1f}s after it was recorded")
        await agent.stop()
