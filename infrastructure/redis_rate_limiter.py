"""Where keys' limits are counted (``application/rate_limits.py`` states the rule): Redis for
controllers that share it, this process's memory otherwise.

:class:`RedisRateLimiter` runs one Lua script per operation (``EVALSHA``; loaded again by the
client when Redis forgot it), so a check and its counting are one atomic step however many
controllers share the key's counters. Per key (``<prefix>limits:<key id>:…``, the prefix
being ``REDIS_KEY_PREFIX`` like the live state's keys): a hash ``rate`` with the two
buckets' theoretical arrival times (``r``, ``t``), a sorted set ``leases`` (lease id →
expiry) and a counter ``month:YYYY-MM``; each expires once it no longer matters.

Redis configured but unreachable: the limiter **fails open**. The request is admitted without
a lease or figures, one warning is logged per outage (and a line when Redis is back), and
``dacp_rate_limiter_unavailable_total`` counts the operations that could not be done.
:class:`InProcessRateLimiter` applies the same rule to a dict (no ``REDIS_URL``).
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
import redis.asyncio
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from application.rate_limits import (
    ALLOWED,
    EPSILON,
    LEASE_TTL,
    WINDOW,
    Limit,
    LimitDecision,
    Usage,
    admitted,
    charged,
    decide,
    month_end,
    month_of,
)
from domain.api_keys import Grant, KeyLimits

log = logging.getLogger(__name__)

#: Below the live state's prefix (``REDIS_KEY_PREFIX``): ``dacp:live:limits:<key id>:…``.
KEY_SPACE = "limits:"
#: A month's counter outlives its month by this much (seconds), for late settlements.
MONTH_GRACE = 31 * 24 * 3600
#: How long one limiter call may wait for Redis (seconds) before the request goes on unlimited.
REDIS_TIMEOUT = 0.5

_ACQUIRE = """
local now = tonumber(ARGV[1])
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local most, monthly = tonumber(ARGV[4]), tonumber(ARGV[5])
local lease, lease_ttl = ARGV[6], tonumber(ARGV[7])
local window, eps = tonumber(ARGV[8]), tonumber(ARGV[9])
local rtat = tonumber(redis.call('HGET', KEYS[1], 'r') or '0')
local ttat = tonumber(redis.call('HGET', KEYS[1], 't') or '0')
local count = 0
if most then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
  count = redis.call('ZCARD', KEYS[2])
end
local month = tonumber(redis.call('GET', KEYS[3]) or '0')
local ok = true
if monthly and month >= monthly then ok = false end
if rpm and (math.max(rtat, now) - now) + window / rpm - window > eps then ok = false end
if tpm and (math.max(ttat, now) - now) - (window - window / tpm) > eps then ok = false end
if most and count >= most then ok = false end
if ok then
  if rpm then
    local tat = math.max(rtat, now) + window / rpm
    redis.call('HSET', KEYS[1], 'r', string.format('%.17g', tat))
    redis.call('PEXPIRE', KEYS[1], math.ceil((math.max(tat, ttat) - now + window) * 1000))
  end
  if most then
    redis.call('ZADD', KEYS[2], string.format('%.17g', now + lease_ttl), lease)
    redis.call('PEXPIRE', KEYS[2], math.ceil(lease_ttl * 1000))
  end
end
return {ok and 1 or 0, string.format('%.17g', rtat), string.format('%.17g', ttat), count, month}
"""

_SETTLE = """
local now, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local window = tonumber(ARGV[6])
if ARGV[4] ~= '' then redis.call('ZREM', KEYS[2], ARGV[4]) end
if tokens > 0 then
  if tpm then
    local rtat = tonumber(redis.call('HGET', KEYS[1], 'r') or '0')
    local ttat = tonumber(redis.call('HGET', KEYS[1], 't') or '0')
    local tat = math.max(ttat, now) + tokens * (window / tpm)
    redis.call('HSET', KEYS[1], 't', string.format('%.17g', tat))
    redis.call('PEXPIRE', KEYS[1], math.ceil((math.max(tat, rtat) - now + window) * 1000))
  end
  redis.call('INCRBY', KEYS[3], tokens)
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
return 1
"""


class CountingLimiter:
    """What both limiters count for ``/metrics``: refusals by limit, and the calls that could
    not reach the shared store (the requests then went on unlimited)."""

    def __init__(self) -> None:
        self.refused: Counter[Limit] = Counter()
        self.unavailable = 0

    def counted(self, decision: LimitDecision) -> LimitDecision:
        if decision.refused is not None:
            self.refused[decision.refused] += 1
        return decision


@dataclass
class _Counters:
    requests_tat: float = 0.0
    tokens_tat: float = 0.0
    leases: dict[str, float] = field(default_factory=dict)  # lease → expiry (unix time)
    month: str = ""
    month_tokens: int = 0

    def usage(self, now: float) -> Usage:
        self.leases = {lease: until for lease, until in self.leases.items() if until > now}
        month = self.month_tokens if self.month == month_of(now) else 0
        return Usage(self.requests_tat, self.tokens_tat, len(self.leases), month)


class InProcessRateLimiter(CountingLimiter):
    """The rule over counters in this process: one controller, no ``REDIS_URL``."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: dict[str, _Counters] = {}
        self._lock = threading.Lock()

    async def acquire(self, grant: Grant, now: float) -> LimitDecision:
        with self._lock:
            counters = self._keys.setdefault(grant.key_id, _Counters())
            usage = counters.usage(now)
            decision = decide(grant.limits, usage, now, lease=uuid.uuid4().hex)
            if decision.allowed:
                counters.requests_tat = admitted(grant.limits, usage, now).requests_tat
                if decision.lease is not None:
                    counters.leases[decision.lease] = now + LEASE_TTL
        return self.counted(decision)

    async def settle(
        self,
        grant: Grant,
        lease: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        now: float,
    ) -> None:
        tokens = prompt_tokens + completion_tokens
        with self._lock:
            counters = self._keys.setdefault(grant.key_id, _Counters())
            if lease is not None:
                counters.leases.pop(lease, None)
            if tokens > 0:
                after = charged(grant.limits, counters.usage(now), tokens, now)
                counters.tokens_tat = after.tokens_tat
                counters.month, counters.month_tokens = month_of(now), after.month_tokens

    async def close(self) -> None:
        pass


def _arg(limit: int | None) -> str:
    return "" if limit is None else str(limit)


class RedisRateLimiter(CountingLimiter):
    """The rule in Redis, one script per operation: every controller on the same Redis (and
    ``REDIS_KEY_PREFIX``) shares each key's limits exactly."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__()
        self._redis = redis.asyncio.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT
        )
        self._prefix = f"{prefix}{KEY_SPACE}"
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._settle = self._redis.register_script(_SETTLE)
        self._failing = False

    def _keys(self, key_id: str, now: float) -> list[str]:
        base = f"{self._prefix}{key_id}:"
        return [f"{base}rate", f"{base}leases", f"{base}month:{month_of(now)}"]

    def _down(self, what: str, error: Exception) -> None:
        self.unavailable += 1
        if not self._failing:
            log.warning("rate limits: Redis unavailable (%s), %s without limits", error, what)
        self._failing = True

    def _up(self) -> None:
        if self._failing:
            log.info("rate limits: Redis is back")
            self._failing = False

    async def acquire(self, grant: Grant, now: float) -> LimitDecision:
        limits: KeyLimits = grant.limits
        lease = uuid.uuid4().hex
        args = [
            repr(now),
            _arg(limits.requests_per_minute),
            _arg(limits.tokens_per_minute),
            _arg(limits.concurrent_requests),
            _arg(limits.monthly_tokens),
            lease,
            repr(LEASE_TTL),
            repr(WINDOW),
            repr(EPSILON),
        ]
        try:
            ok, rtat, ttat, count, month = await self._acquire(
                keys=self._keys(grant.key_id, now), args=args
            )
        except (redis.RedisError, OSError) as e:
            self._down("requests go on", e)
            return ALLOWED
        self._up()
        usage = Usage(float(rtat), float(ttat), int(count), int(month))
        decision = decide(limits, usage, now, lease=lease)
        if decision.allowed != bool(ok):  # cannot happen: the script applies the same rule
            log.error("rate limits: the script and the rule disagree for %s", grant.key_id)
        return self.counted(decision)

    async def settle(
        self,
        grant: Grant,
        lease: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        now: float,
    ) -> None:
        tokens = prompt_tokens + completion_tokens
        if lease is None and tokens <= 0:
            return
        args = [
            repr(now),
            _arg(grant.limits.tokens_per_minute),
            str(max(0, tokens)),
            lease or "",
            str(math.ceil(month_end(now) - now) + MONTH_GRACE),
            repr(WINDOW),
        ]
        try:
            await self._settle(keys=self._keys(grant.key_id, now), args=args)
        except (redis.RedisError, OSError) as e:
            self._down("a job's tokens go uncharged", e)
            return
        self._up()

    async def close(self) -> None:
        await self._redis.aclose()


#: Either limiter: the port, and the counts ``/metrics`` reads (:class:`LimiterCollector`).
KeyLimiter = InProcessRateLimiter | RedisRateLimiter


def rate_limiter_for(redis_url: str | None, prefix: str) -> KeyLimiter:
    """Redis's limiter when ``REDIS_URL`` is configured, else this process's."""
    if not redis_url:
        return InProcessRateLimiter()
    return RedisRateLimiter(redis_url, prefix)


class LimiterCollector(Collector):
    """``dacp_rate_limit_refusals_total{limit}`` and ``dacp_rate_limiter_unavailable_total``."""

    def __init__(self, limiter: CountingLimiter) -> None:
        self._limiter = limiter

    def collect(self) -> Iterable[Metric]:
        refusals = CounterMetricFamily(
            "dacp_rate_limit_refusals",
            "Requests refused with 429 by a key's limit (requests, tokens, concurrency, monthly).",
            labels=["limit"],
        )
        for limit in Limit:
            refusals.add_metric([limit.value], self._limiter.refused[limit])
        yield refusals
        yield CounterMetricFamily(
            "dacp_rate_limiter_unavailable",
            "Rate limiter calls that could not reach Redis (the request went on unlimited).",
            value=self._limiter.unavailable,
        )
