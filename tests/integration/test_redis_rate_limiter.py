"""Per-key limits on real Redis: the scenarios of tests/unit/test_rate_limits.py, each with two
:class:`RedisRateLimiter` instances (two controllers) on one key prefix, plus what only Redis
has: keys that expire, a script Redis forgot, Redis down (the limiter fails open)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from application.ports import RateLimiter
from application.rate_limits import LEASE_TTL
from infrastructure.redis_rate_limiter import KEY_SPACE, LimiterCollector, RedisRateLimiter
from tests.conftest import TEST_REDIS_URL
from tests.unit.test_rate_limits import (  # noqa: F401  (collected here again, on Redis)
    T0,
    Limiters,
    grant,
    test_a_key_without_a_concurrency_limit_takes_no_lease,
    test_a_lease_never_settled_expires_after_its_ttl,
    test_a_refused_request_counts_nothing,
    test_a_settled_lease_frees_its_place,
    test_request_n_plus_one_in_a_minute_is_refused_until_its_retry_after,
    test_the_monthly_budget_is_named_before_any_rate,
    test_the_monthly_budget_refuses_until_the_next_month,
    test_the_requests_bucket_refills_at_the_rate_and_reports_its_reset,
    test_tokens_charged_after_the_job_put_the_bucket_in_debt,
    test_two_controllers_share_one_limit_exactly,
)


@pytest.fixture
def prefix() -> Iterator[str]:
    prefix = f"dacp-test:limits:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(TEST_REDIS_URL)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


@pytest.fixture
async def limiters(prefix: str) -> AsyncIterator[Limiters]:
    """Every call is another controller on the same Redis and prefix."""
    made: list[RedisRateLimiter] = []

    def another() -> RateLimiter:
        made.append(RedisRateLimiter(TEST_REDIS_URL, prefix))
        return made[-1]

    yield another
    for limiter in made:
        await limiter.close()


async def test_the_counters_live_under_the_prefix_and_expire(
    limiters: Limiters, prefix: str
) -> None:
    limiter, key = limiters(), grant(requests_per_minute=60, concurrent_requests=2)
    decision = await limiter.acquire(key, T0)
    await limiter.settle(key, None, 5, 5, T0)
    client = redis.Redis.from_url(TEST_REDIS_URL)
    base = f"{prefix}{KEY_SPACE}k1:"
    assert client.zscore(f"{base}leases", decision.lease or "") == pytest.approx(T0 + LEASE_TTL)
    assert int(client.get(f"{base}month:2025-03") or 0) == 10
    for name in ("rate", "leases", "month:2025-03"):
        assert client.ttl(f"{base}{name}") > 0, name


async def test_a_script_redis_forgot_is_loaded_again(limiters: Limiters) -> None:
    limiter, key = limiters(), grant(requests_per_minute=2)
    assert (await limiter.acquire(key, T0)).allowed
    redis.Redis.from_url(TEST_REDIS_URL).script_flush()
    assert (await limiter.acquire(key, T0)).allowed
    assert not (await limiter.acquire(key, T0)).allowed


async def test_redis_down_fails_open_with_one_warning_and_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = RedisRateLimiter("redis://127.0.0.1:1/0", "dacp-test:down:")
    key = grant(requests_per_minute=1, concurrent_requests=1)
    with caplog.at_level(logging.WARNING):
        answers = [await down.acquire(key, T0) for _ in range(3)]
        await down.settle(key, None, 10, 10, T0)
    assert all(a.allowed and a.lease is None and a.requests is None for a in answers)
    assert down.unavailable == 4
    assert sum("Redis unavailable" in r.message for r in caplog.records) == 1
    figures = {m.name: m for m in LimiterCollector(down).collect()}
    assert figures["dacp_rate_limiter_unavailable"].samples[0].value == 4
    await down.close()
