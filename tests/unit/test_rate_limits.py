"""Per-key limits (application/rate_limits.py) on a fake clock: each ``now`` is given, nothing
sleeps. The scenarios take a ``limiters`` factory (two calls: two controllers sharing the
counters); tests/integration/test_redis_rate_limiter.py runs the same ones on real Redis."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from application.ports import RateLimiter
from application.rate_limits import (
    CONCURRENCY_RETRY_AFTER,
    LEASE_TTL,
    Limit,
    Usage,
    admitted,
    charged,
    decide,
    limited,
    month_end,
    month_of,
)
from domain.api_keys import BOOTSTRAP, OPEN, Grant, KeyLimits
from infrastructure.redis_rate_limiter import InProcessRateLimiter

#: Some time in the middle of a month, so the month does not change under a scenario.
T0 = datetime(2025, 3, 10, 12, 0, tzinfo=UTC).timestamp()

Limiters = Callable[[], RateLimiter]


@pytest.fixture
def limiters() -> Limiters:
    """Every call is another controller; in process there is one, holding the counters."""
    one = InProcessRateLimiter()
    return lambda: one


def grant(**limits: int) -> Grant:
    return Grant(key_id="k1", name="team", limits=KeyLimits(**limits))


# --- requests per minute ---------------------------------------------------------------------


async def test_request_n_plus_one_in_a_minute_is_refused_until_its_retry_after(
    limiters: Limiters,
) -> None:
    limiter, key = limiters(), grant(requests_per_minute=60)
    for n in range(60):  # the burst is the limit
        decision = await limiter.acquire(key, T0)
        assert decision.allowed and decision.requests is not None
        assert decision.requests.remaining == 59 - n
    refused = await limiter.acquire(key, T0)
    assert not refused.allowed and refused.refused is Limit.REQUESTS
    assert (refused.limit, refused.used) == (60, 60)
    assert refused.retry_after == pytest.approx(1.0)
    again = await limiter.acquire(key, T0 + 0.5)
    assert not again.allowed and again.retry_after == pytest.approx(0.5)
    assert (await limiter.acquire(key, T0 + 1.0)).allowed  # after exactly retry_after
    late = await limiter.acquire(key, T0 + 1.0)
    assert not late.allowed and late.retry_after == pytest.approx(1.0)


async def test_the_requests_bucket_refills_at_the_rate_and_reports_its_reset(
    limiters: Limiters,
) -> None:
    limiter, key = limiters(), grant(requests_per_minute=6)
    first = await limiter.acquire(key, T0)
    assert first.requests is not None
    assert (first.requests.limit, first.requests.remaining) == (6, 5)
    assert first.requests.reset == pytest.approx(10.0)  # one request takes 10 s of the minute
    for _ in range(5):
        assert (await limiter.acquire(key, T0)).allowed
    assert not (await limiter.acquire(key, T0 + 9.9)).allowed
    later = await limiter.acquire(key, T0 + 60)  # a minute later the bucket is full
    assert later.allowed and later.requests is not None and later.requests.remaining == 5


async def test_two_controllers_share_one_limit_exactly(limiters: Limiters) -> None:
    here, there, key = limiters(), limiters(), grant(requests_per_minute=10)
    answers = [await (here if n % 2 else there).acquire(key, T0) for n in range(25)]
    assert sum(a.allowed for a in answers) == 10
    assert all(a.allowed for a in answers[:10])


# --- tokens per minute -----------------------------------------------------------------------


async def test_tokens_charged_after_the_job_put_the_bucket_in_debt(limiters: Limiters) -> None:
    limiter, key = limiters(), grant(tokens_per_minute=600)  # a token is 0.1 s of the minute
    decision = await limiter.acquire(key, T0)
    assert decision.allowed and decision.tokens is not None
    assert (decision.tokens.limit, decision.tokens.remaining) == (600, 600)
    await limiter.settle(key, decision.lease, 400, 600, T0)  # 1000 tokens: 400 in debt
    refused = await limiter.acquire(key, T0 + 1)
    assert not refused.allowed and refused.refused is Limit.TOKENS
    assert refused.limit == 600 and refused.used == 990  # 10 paid back in the second
    # Allowed again once less than the limit is in the bucket: 1000 - 599 tokens drained.
    assert refused.retry_after == pytest.approx(100 - 59.9 - 1)
    assert not (await limiter.acquire(key, T0 + 40)).allowed
    back = await limiter.acquire(key, T0 + 40.1)
    assert back.allowed and back.tokens is not None and back.tokens.remaining == 1


async def test_a_refused_request_counts_nothing(limiters: Limiters) -> None:
    limiter = limiters()
    key = grant(requests_per_minute=60, tokens_per_minute=60, concurrent_requests=5)
    admitted_ = await limiter.acquire(key, T0)
    await limiter.settle(key, admitted_.lease, 100, 0, T0)  # in debt: refused for a while
    for _ in range(100):
        assert not (await limiter.acquire(key, T0)).allowed
    # Neither requests nor leases were taken by the refusals.
    back = await limiter.acquire(key, T0 + 41)
    assert back.allowed and back.requests is not None and back.requests.remaining == 59
    for _ in range(4):
        assert (await limiter.acquire(key, T0 + 41)).allowed


# --- concurrency -----------------------------------------------------------------------------


async def test_a_settled_lease_frees_its_place(limiters: Limiters) -> None:
    limiter, key = limiters(), grant(concurrent_requests=2)
    a, b = await limiter.acquire(key, T0), await limiter.acquire(key, T0)
    assert a.allowed and b.allowed and a.lease and b.lease and a.lease != b.lease
    refused = await limiter.acquire(key, T0)
    assert not refused.allowed and refused.refused is Limit.CONCURRENCY
    assert (refused.limit, refused.used, refused.retry_after) == (2, 2, CONCURRENCY_RETRY_AFTER)
    await limiter.settle(key, a.lease, 0, 0, T0 + 1)  # however the job ended
    assert (await limiter.acquire(key, T0 + 1)).allowed
    assert not (await limiter.acquire(key, T0 + 1)).allowed


async def test_a_lease_never_settled_expires_after_its_ttl(limiters: Limiters) -> None:
    limiter, key = limiters(), grant(concurrent_requests=1)
    assert (await limiter.acquire(key, T0)).allowed  # its controller crashed: never settled
    assert not (await limiter.acquire(key, T0 + LEASE_TTL - 1)).allowed
    assert (await limiter.acquire(key, T0 + LEASE_TTL)).allowed


async def test_a_key_without_a_concurrency_limit_takes_no_lease(limiters: Limiters) -> None:
    decision = await limiters().acquire(grant(requests_per_minute=5), T0)
    assert decision.allowed and decision.lease is None


# --- monthly budget --------------------------------------------------------------------------


async def test_the_monthly_budget_refuses_until_the_next_month(limiters: Limiters) -> None:
    limiter, key = limiters(), grant(monthly_tokens=1000)
    late_january = datetime(2025, 1, 31, 23, 0, tzinfo=UTC).timestamp()
    first = await limiter.acquire(key, late_january)
    await limiter.settle(key, first.lease, 900, 200, late_january)  # over: 1100 of 1000
    refused = await limiter.acquire(key, late_january + 60)
    assert not refused.allowed and refused.refused is Limit.MONTHLY
    assert (refused.limit, refused.used) == (1000, 1100)
    assert refused.retry_after == pytest.approx(3600 - 60)
    february = datetime(2025, 2, 1, tzinfo=UTC).timestamp()
    assert not (await limiter.acquire(key, february - 0.001)).allowed
    assert (await limiter.acquire(key, february)).allowed


async def test_the_monthly_budget_is_named_before_any_rate(limiters: Limiters) -> None:
    limiter, key = limiters(), grant(monthly_tokens=10, requests_per_minute=1)
    first = await limiter.acquire(key, T0)
    await limiter.settle(key, first.lease, 10, 0, T0)
    refused = await limiter.acquire(key, T0)
    assert refused.refused is Limit.MONTHLY


# --- the rule --------------------------------------------------------------------------------


def test_grants_without_limits_are_not_limited() -> None:
    assert not limited(BOOTSTRAP) and not limited(OPEN)
    assert not limited(grant()) and limited(grant(monthly_tokens=1))


def test_months_are_utc_calendar_months() -> None:
    december = datetime(2024, 12, 31, 23, 59, tzinfo=UTC).timestamp()
    assert month_of(december) == "2024-12"
    assert month_end(december) == datetime(2025, 1, 1, tzinfo=UTC).timestamp()
    assert month_of(month_end(december)) == "2025-01"


def test_the_longest_wait_is_named_when_several_rates_refuse() -> None:
    limits = KeyLimits(requests_per_minute=60, tokens_per_minute=60)
    usage = Usage(requests_tat=T0 + 60, tokens_tat=T0 + 120, concurrent=0)
    decision = decide(limits, usage, T0)
    assert decision.refused is Limit.TOKENS and decision.retry_after == pytest.approx(61)


@settings(max_examples=200, deadline=None)
@given(
    rpm=st.integers(1, 120),
    gaps=st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=300),
)
def test_no_span_admits_more_than_the_burst_plus_the_rate(rpm: int, gaps: list[float]) -> None:
    """GCRA's bound: any span of L seconds admits at most rpm + L * rpm / 60 requests (a full
    minute's burst, then the rate)."""
    limits, usage, now, times = KeyLimits(requests_per_minute=rpm), Usage(), T0, []
    for gap in gaps:
        now += gap
        if decide(limits, usage, now).allowed:
            usage = admitted(limits, usage, now)
            times.append(now)
    for i, start in enumerate(times):
        for j in range(i, len(times)):
            span = times[j] - start
            assert j - i + 1 <= rpm + int(span * rpm / 60 + 1e-6)


@settings(max_examples=200, deadline=None)
@given(
    tpm=st.integers(1, 10_000),
    jobs=st.lists(st.tuples(st.floats(0, 30, allow_nan=False), st.integers(0, 5000)), max_size=60),
)
def test_tokens_are_admitted_only_while_the_bucket_is_not_in_debt(
    tpm: int, jobs: list[tuple[float, int]]
) -> None:
    """Charged after each job: a request is admitted only while the tokens charged over the
    span before it stay below the bucket (limit + the span's refill)."""
    limits, usage, now = KeyLimits(tokens_per_minute=tpm), Usage(), T0
    charges: list[tuple[float, int]] = []
    for gap, tokens in jobs:
        now += gap
        if decide(limits, usage, now).allowed:
            for at, _ in charges:
                spent = sum(t for when, t in charges if when >= at)
                assert spent < tpm + (now - at) * tpm / 60 + 1e-6
            usage = charged(limits, usage, tokens, now)
            charges.append((now, tokens))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.lists(st.booleans(), max_size=80))
async def test_concurrency_never_exceeds_the_limit(most: int, steps: list[bool]) -> None:
    limiter, key = InProcessRateLimiter(), grant(concurrent_requests=most)
    held: list[str | None] = []
    for start in steps:
        if start:
            decision = await limiter.acquire(key, T0)
            assert decision.allowed == (len(held) < most)
            if decision.allowed:
                held.append(decision.lease)
        elif held:
            await limiter.settle(key, held.pop(0), 1, 1, T0)
        assert len(held) <= most
