"""A key's limits as OpenAI answers them (interfaces/http/openai/openai_limits.py): the 429's
JSON, message and headers for each limit, the ``x-ratelimit-*`` figures, and a request's hold
settled exactly once; a grant without limits never reaches the limiter."""

from __future__ import annotations

import asyncio

import pytest

from application.rate_limits import Figures, Limit, LimitDecision
from domain.api_keys import BOOTSTRAP, OPEN, Grant, KeyLimits
from interfaces.http.http_errors import ApiError, error_body
from interfaces.http.openai.openai_limits import (
    INSUFFICIENT_QUOTA,
    RATE_LIMIT_EXCEEDED,
    UNLIMITED,
    KeyCharge,
    duration,
    key_charge,
    rate_limited,
)

KEY = Grant(key_id="k1", name="team", limits=KeyLimits(requests_per_minute=60))
FIGURES = LimitDecision(
    True, requests=Figures(60, 59, 1.0), tokens=Figures(1000, 250, 45.0), lease="l1"
)


class Recording:
    """A limiter that records what it is asked and admits (or refuses) as told."""

    def __init__(self, decision: LimitDecision = FIGURES) -> None:
        self.decision = decision
        self.acquired: list[tuple[str, float]] = []
        self.settled: list[tuple[str, str | None, int, int, float]] = []

    async def acquire(self, grant: Grant, now: float) -> LimitDecision:
        self.acquired.append((grant.key_id, now))
        return self.decision

    async def settle(
        self, grant: Grant, lease: str | None, prompt: int, completion: int, now: float
    ) -> None:
        self.settled.append((grant.key_id, lease, prompt, completion, now))

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0203, "21ms"), (1.2, "1.2s"), (59.999, "59.999s"), (360, "6m0s"), (3723.5, "1h2m3.5s")],
)
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_requests_per_minute_refused_as_openai_says_it() -> None:
    error = rate_limited(
        LimitDecision(
            False,
            refused=Limit.REQUESTS,
            retry_after=1.2,
            limit=60,
            used=60,
            requests=Figures(60, 0, 60.0),
        )
    )
    assert error.status == 429
    assert error_body(error.message, error.type, error.code)["error"] == {
        "message": "Rate limit reached for requests per minute (RPM): Limit 60, Used 60, "
        "Requested 1. Please try again in 1.2s.",
        "type": "requests",
        "param": None,
        "code": RATE_LIMIT_EXCEEDED,
    }
    assert error.headers == {
        "Retry-After": "2",  # whole seconds, rounded up
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
    }


def test_tokens_concurrency_and_the_month_are_named() -> None:
    tokens = rate_limited(LimitDecision(False, refused=Limit.TOKENS, retry_after=0.2, limit=9))
    assert tokens.type == "tokens" and tokens.code == RATE_LIMIT_EXCEEDED
    assert "tokens per minute (TPM): Limit 9" in tokens.message
    assert tokens.headers["Retry-After"] == "1"  # never below one second
    busy = rate_limited(LimitDecision(False, refused=Limit.CONCURRENCY, retry_after=1, limit=2))
    assert busy.type == "requests" and "concurrent requests: Limit 2" in busy.message
    month = rate_limited(
        LimitDecision(False, refused=Limit.MONTHLY, retry_after=86400.5, limit=100, used=120)
    )
    assert (month.status, month.type, month.code) == (429, INSUFFICIENT_QUOTA, INSUFFICIENT_QUOTA)
    assert "monthly token budget: Limit 100, Used 120" in month.message
    assert month.headers["Retry-After"] == "86401"
    assert month.headers["x-should-retry"] == "false"  # the SDKs give up at once


async def test_a_grant_without_limits_never_reaches_the_limiter() -> None:
    limiter = Recording()
    for grant in (BOOTSTRAP, OPEN, Grant(key_id="k", name="n")):
        assert await key_charge(limiter, grant) is UNLIMITED
    assert await key_charge(None, KEY) is UNLIMITED
    assert limiter.acquired == []
    UNLIMITED.settle(5, 5)
    assert UNLIMITED.settled is None and UNLIMITED.headers == {}


async def test_an_admitted_request_carries_the_figures_and_settles_once() -> None:
    limiter = Recording()
    charge = await key_charge(limiter, KEY, clock=lambda: 100.0)
    assert charge.headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "250",
        "x-ratelimit-reset-tokens": "45s",
    }
    charge.settle(3, 4)
    charge.settle(0, 9)  # the second ending (a finally after the stream's) does nothing
    assert charge.settled is not None
    await charge.settled
    assert limiter.acquired == [("k1", 100.0)]
    assert limiter.settled == [("k1", "l1", 3, 4, 100.0)]


async def test_a_refusal_raises_the_429_and_holds_nothing() -> None:
    limiter = Recording(LimitDecision(False, refused=Limit.REQUESTS, retry_after=1, limit=1))
    with pytest.raises(ApiError) as caught:
        await key_charge(limiter, KEY)
    assert caught.value.status == 429 and caught.value.code == RATE_LIMIT_EXCEEDED


async def test_a_settlement_survives_the_cancellation_of_its_request() -> None:
    limiter = Recording()
    charge = KeyCharge(limiter, KEY, FIGURES, clock=lambda: 1.0)

    async def handler() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            charge.settle(0, 2)

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert charge.settled is not None
    await charge.settled
    assert limiter.settled == [("k1", "l1", 0, 2, 1.0)]
