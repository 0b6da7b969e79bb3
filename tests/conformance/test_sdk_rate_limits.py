"""The official Python ``openai`` SDK against a key's limits: it retries a 429 after the
``Retry-After`` the controller sends, by itself (its default ``max_retries`` of 2), and gives
up at once on ``insufficient_quota``. A controller with FakeAgents (no llama.cpp needed)."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from domain.api_keys import Grant, KeyLimits
from interfaces.controller_main import RunningController
from tests.integration.test_key_limits_flow import ctl, limited_key, serving

__all__ = ["ctl"]  # the controller fixture, used here by name

pytestmark = pytest.mark.timeout(120)


def sdk(ctl: RunningController, key: str, statuses: list[int]) -> openai.AsyncOpenAI:
    """The SDK with its default retries; ``statuses`` gets every status the server answered."""

    async def seen(response: Any) -> None:
        statuses.append(response.status_code)

    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{ctl.http_port}/v1",
        api_key=key,
        http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen]}),
    )


async def test_the_sdk_waits_out_a_429_and_succeeds(ctl: RunningController) -> None:
    async with serving(ctl) as (_, client):
        key_id, headers = await limited_key(client, requests_per_minute=60)
        # The minute's 60 requests were made (elsewhere: another controller, say).
        grant = Grant(key_id=key_id, name="team", limits=KeyLimits(requests_per_minute=60))
        assert ctl.services.limiter is not None
        for _ in range(60):
            assert (await ctl.services.limiter.acquire(grant, time.time())).allowed
        statuses: list[int] = []
        started = time.monotonic()
        answer = await sdk(ctl, headers["Authorization"][7:], statuses).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
        elapsed = time.monotonic() - started
    assert answer.choices[0].message.content == "Hello world"
    assert statuses[0] == 429 and statuses[-1] == 200 and len(statuses) <= 3
    assert elapsed >= 1.0  # Retry-After: 1 (a request is a second of a 60/minute bucket)


async def test_the_sdk_does_not_retry_an_exhausted_monthly_budget(ctl: RunningController) -> None:
    async with serving(ctl) as (_, client):
        key_id, headers = await limited_key(client, monthly_tokens=1)
        assert ctl.services.limiter is not None
        grant = Grant(key_id=key_id, name="team", limits=KeyLimits(monthly_tokens=1))
        await ctl.services.limiter.settle(grant, None, 1, 0, time.time())
        statuses: list[int] = []
        with pytest.raises(openai.RateLimitError) as caught:
            await sdk(ctl, headers["Authorization"][7:], statuses).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
    assert statuses == [429]  # x-should-retry: false
    assert caught.value.code == "insufficient_quota"
