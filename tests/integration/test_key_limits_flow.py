"""A managed key's limits over HTTP, on a controller with real Postgres, Redis and gRPC and a
FakeAgent: 429s with OpenAI's JSON and headers at the limits, the ``x-ratelimit-*`` figures
on successful answers, tokens charged from the job's usage, and the concurrency lease
released however a request ends (answered, streamed, failed, abandoned by its client)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import redis

from interfaces.controller_main import RunningController
from tests.conftest import TEST_REDIS_URL
from tests.controller_fixture import controller_fixture
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_job_flow import ADMIN, SHA, agents, http, register
from wire import control_pb2 as pb

ctl = controller_fixture(rpc_worker_timeout=1.0, setup_timeout=2.0)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
#: What one job of the FakeAgent uses: its prompt tokens and its two words.
JOB_TOKENS = 7 + 2


async def limited_key(client: httpx.AsyncClient, **limits: int) -> tuple[str, dict[str, str]]:
    """A new key with ``limits``: its id, and the headers that use it."""
    r = await client.post(
        "/api/admin/api-keys", headers=ADMIN, json={"name": "team", "limits": limits}
    )
    assert r.status_code == 201, r.text
    return r.json()["id"], {"Authorization": f"Bearer {r.json()['key']}"}


@asynccontextmanager
async def serving(
    ctl: RunningController, **spec: Any
) -> AsyncIterator[tuple[FakeAgent, httpx.AsyncClient]]:
    """One agent serving model ``m``, and a client of the controller."""
    (agent,) = await agents(ctl, {"name": "a", "holds": SHA, "memory": 4 << 30, **spec})
    async with http(ctl) as client:
        await register(ctl, client)
        yield agent, client


def counters(ctl: RunningController, key_id: str) -> redis.Redis:
    assert ctl.services.limiter is not None and ctl.services.settings.redis_url
    return redis.Redis.from_url(TEST_REDIS_URL)


def leases(ctl: RunningController, key_id: str) -> int:
    prefix = ctl.services.settings.redis_key_prefix
    return int(counters(ctl, key_id).zcard(f"{prefix}limits:{key_id}:leases"))


async def until_no_lease(ctl: RunningController, key_id: str) -> None:
    deadline = time.monotonic() + 10
    while leases(ctl, key_id):
        assert time.monotonic() < deadline, "the lease was never released"
        await asyncio.sleep(0.02)


async def test_the_request_over_the_limit_gets_openais_429(ctl: RunningController) -> None:
    async with serving(ctl) as (_, client):
        _, key = await limited_key(client, requests_per_minute=2, tokens_per_minute=1000)
        first = await client.post("/v1/chat/completions", headers=key, json=CHAT)
        assert first.status_code == 200, first.text
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-reset-requests"] == "30s"
        assert first.headers["x-ratelimit-limit-tokens"] == "1000"
        assert first.headers["x-ratelimit-remaining-tokens"] == "1000"  # charged after it
        second = await client.post("/v1/chat/completions", headers=key, json=CHAT)
        assert second.status_code == 200
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(second.headers["x-ratelimit-remaining-tokens"]) <= 1000 - JOB_TOKENS
        third = await client.post("/v1/chat/completions", headers=key, json=CHAT)
        assert third.status_code == 429
        error = third.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert error["message"].startswith(
            "Rate limit reached for requests per minute (RPM): Limit 2, Used 2, Requested 1."
        )
        assert 28 <= int(third.headers["Retry-After"]) <= 30
        assert third.headers["x-ratelimit-remaining-requests"] == "0"
        # The bootstrap key has no limits: never refused.
        boot = {"Authorization": "Bearer test-ai-key"}
        assert (await client.post("/v1/chat/completions", headers=boot, json=CHAT)).is_success
        assert (
            "x-ratelimit-limit-requests"
            not in (await client.post("/v1/chat/completions", headers=boot, json=CHAT)).headers
        )


async def test_the_monthly_budget_is_charged_with_the_jobs_usage(ctl: RunningController) -> None:
    async with serving(ctl) as (_, client):
        _, key = await limited_key(client, monthly_tokens=JOB_TOKENS)
        assert (await client.post("/v1/chat/completions", headers=key, json=CHAT)).is_success
        refused = await client.post("/v1/chat/completions", headers=key, json=CHAT)
        for _ in range(50):  # the settlement runs as a task of its own, just after the answer
            if refused.status_code == 429:
                break
            await asyncio.sleep(0.02)
            refused = await client.post("/v1/chat/completions", headers=key, json=CHAT)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == error["type"] == "insufficient_quota"
        assert f"Limit {JOB_TOKENS}, Used {JOB_TOKENS}" in error["message"]
        assert refused.headers["x-should-retry"] == "false"


async def test_a_concurrency_lease_is_released_however_the_request_ends(
    ctl: RunningController,
) -> None:
    async with serving(ctl, words=tuple(f" w{i}" for i in range(100))) as (agent, client):
        key_id, key = await limited_key(client, concurrent_requests=1)
        # Answered whole.
        assert (await client.post("/v1/chat/completions", headers=key, json=CHAT)).is_success
        await until_no_lease(ctl, key_id)
        # Streamed to its end.
        stream = {**CHAT, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", headers=key, json=stream) as r:
            assert r.status_code == 200
            assert "[DONE]" in "".join([line async for line in r.aiter_lines()])
        await until_no_lease(ctl, key_id)
        # Abandoned by its client mid-stream: while it runs a second request is refused.
        agent.word_delay = 0.02
        async with client.stream("POST", "/v1/chat/completions", headers=key, json=stream) as r:
            lines = r.aiter_lines()  # kept: a dropped iterator closes the response
            async for line in lines:
                if '"content":" w' in line:
                    break
            busy = await client.post("/v1/chat/completions", headers=key, json=CHAT)
            assert busy.status_code == 429
            assert "concurrent requests: Limit 1, Used 1" in busy.json()["error"]["message"]
        await until_no_lease(ctl, key_id)
        # Failed in setup.
        agent.word_delay = 0.0
        agent.fail_setup = pb.SetupResult(ok=False, error="no luck")
        failed = await client.post("/v1/chat/completions", headers=key, json=CHAT)
        assert failed.status_code >= 500
        await until_no_lease(ctl, key_id)
