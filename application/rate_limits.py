"""Per-key limits (issue 25): the rule, as pure functions of a key's counters and the time.

A key's :class:`~domain.api_keys.KeyLimits` are checked at once, before its request's job is
submitted (:func:`decide`), and what the job used is charged when it ends (:func:`charged`):

* **requests per minute**: GCRA (a token bucket) with burst = the limit. Each request moves
  the key's *theoretical arrival time* ``requests_tat`` on by ``60 / limit`` seconds; a request
  is refused while that would put it more than :data:`WINDOW` ahead of now. So a full bucket
  takes ``limit`` requests at once, then one every ``60 / limit`` seconds: any span of ``L``
  seconds admits at most ``limit + L * limit / 60`` requests.
* **tokens per minute** (prompt plus completion): the same bucket over tokens, charged after
  the job (its size is known only then), so it may go into debt: a request is refused while
  less than one token is left, until the debt is paid back by time.
* **concurrent requests**: one lease per admitted request, released when it is settled. A
  lease that is never settled (its controller crashed) stops counting :data:`LEASE_TTL` after
  it was taken; nothing refreshes it, so a request running longer stops counting too.
* **monthly tokens**: a counter per calendar month (UTC, ``YYYY-MM``); a request is refused
  once the month's tokens reached the budget (``insufficient_quota``), until the next month.

The adapters (``infrastructure/redis_rate_limiter.py``: Redis for controllers that share it,
in process otherwise) hold the counters and apply this rule atomically; a grant without any
limit (``AI_API_KEY``, an open cluster) never reaches them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum

from domain.api_keys import Grant, KeyLimits

#: The span of the per-minute limits, seconds.
WINDOW = 60.0
#: How long a concurrency lease counts when it is never settled (a controller that crashed
#: with the request running), seconds. Nothing refreshes a lease.
LEASE_TTL = 3600.0
#: What a refusal for concurrency asks the client to wait: a running request may end any time.
CONCURRENCY_RETRY_AFTER = 1.0
#: Slack for float rounding in the comparisons (seconds): waiting exactly ``retry_after`` is
#: enough.
EPSILON = 1e-6


class Limit(StrEnum):
    """Which of a key's limits refused a request."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"
    MONTHLY = "monthly"


@dataclass(frozen=True)
class Figures:
    """One rate's ``x-ratelimit-*`` figures: its limit, what is left after this request, and
    the seconds until the bucket is full again."""

    limit: int
    remaining: int
    reset: float


@dataclass(frozen=True)
class LimitDecision:
    """A key's request admitted (``lease``: its concurrency lease, None when the key has no
    concurrency limit or the limiter could not be asked) or refused: by which limit, what the
    limit is and how much of it is used, and when to try again (seconds). ``requests`` and
    ``tokens`` are the figures of the key's per-minute limits (None: no such limit)."""

    allowed: bool
    lease: str | None = None
    refused: Limit | None = None
    retry_after: float = 0.0
    limit: int = 0
    used: int = 0
    requests: Figures | None = None
    tokens: Figures | None = None


#: The answer when the limiter is not asked (or cannot be): allowed, no figures, no lease.
ALLOWED = LimitDecision(allowed=True)


@dataclass(frozen=True)
class Usage:
    """A key's counters at a moment: the buckets' theoretical arrival times (unix seconds), the
    leases that still count, and the tokens charged in the current month."""

    requests_tat: float = 0.0
    tokens_tat: float = 0.0
    concurrent: int = 0
    month_tokens: int = 0


def limited(grant: Grant) -> bool:
    """Whether the grant has a limit at all (if not, the limiter is never asked)."""
    return not grant.limits.unlimited()


def interval(per_minute: int) -> float:
    """The seconds one request (or token) takes of a per-minute bucket."""
    return WINDOW / per_minute


def month_of(now: float) -> str:
    """The calendar month (UTC) of unix time ``now``, as ``YYYY-MM``."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m")


def month_end(now: float) -> float:
    """Unix time of the first instant of the month after ``now``'s (UTC)."""
    at = datetime.fromtimestamp(now, UTC)
    year, month = (at.year + 1, 1) if at.month == 12 else (at.year, at.month + 1)
    return datetime(year, month, 1, tzinfo=UTC).timestamp()


def _requests(limit: int, tat: float, now: float) -> tuple[float | None, int, float]:
    """(seconds to wait or None, used, seconds until full) of the requests bucket."""
    step = interval(limit)
    ahead = max(tat, now) - now
    used = min(limit, max(0, math.ceil(ahead / step - EPSILON)))
    wait = ahead + step - WINDOW
    return (wait if wait > EPSILON else None), used, ahead


def _tokens(limit: int, tat: float, now: float) -> tuple[float | None, int, float]:
    """(seconds to wait or None, used, seconds until full) of the tokens bucket: it refuses
    while less than one token is left (in debt, or empty)."""
    step = interval(limit)
    ahead = max(tat, now) - now
    used = max(0, math.ceil(ahead / step - EPSILON))
    wait = ahead - (WINDOW - step)
    return (wait if wait > EPSILON else None), used, ahead


def _remaining(limit: int, ahead: float) -> int:
    return max(0, math.floor((WINDOW - ahead) / interval(limit) + EPSILON))


def decide(limits: KeyLimits, usage: Usage, now: float, lease: str | None = None) -> LimitDecision:
    """Whether a request of a key with ``limits`` and counters ``usage`` is admitted at
    ``now``; on admission ``lease`` is its concurrency lease (kept only when the key has a
    concurrency limit). The monthly budget is named first when it refuses; else the limit
    with the longest wait."""
    refusals: list[tuple[float, Limit, int, int]] = []  # (wait, limit, its value, used)
    if limits.monthly_tokens is not None and usage.month_tokens >= limits.monthly_tokens:
        refusals.append(
            (month_end(now) - now, Limit.MONTHLY, limits.monthly_tokens, usage.month_tokens)
        )
    requests = tokens = None
    if (rpm := limits.requests_per_minute) is not None:
        wait, used, ahead = _requests(rpm, usage.requests_tat, now)
        if wait is not None:
            refusals.append((wait, Limit.REQUESTS, rpm, used))
            requests = Figures(rpm, 0, ahead)
        else:
            after = ahead + interval(rpm)
            requests = Figures(rpm, _remaining(rpm, after), after)
    if (tpm := limits.tokens_per_minute) is not None:
        wait, used, ahead = _tokens(tpm, usage.tokens_tat, now)
        if wait is not None:
            refusals.append((wait, Limit.TOKENS, tpm, used))
        tokens = Figures(tpm, _remaining(tpm, ahead), ahead)
    if (most := limits.concurrent_requests) is not None and usage.concurrent >= most:
        refusals.append((CONCURRENCY_RETRY_AFTER, Limit.CONCURRENCY, most, usage.concurrent))
    if not refusals:
        kept = lease if limits.concurrent_requests is not None else None
        return LimitDecision(True, lease=kept, requests=requests, tokens=tokens)
    monthly = [r for r in refusals if r[1] is Limit.MONTHLY]
    wait, which, value, used = monthly[0] if monthly else max(refusals, key=lambda r: r[0])
    return LimitDecision(
        False,
        refused=which,
        retry_after=wait,
        limit=value,
        used=used,
        requests=requests,
        tokens=tokens,
    )


def admitted(limits: KeyLimits, usage: Usage, now: float) -> Usage:
    """The counters once a request is admitted at ``now``: one request counted, one lease."""
    tat = usage.requests_tat
    if (rpm := limits.requests_per_minute) is not None:
        tat = max(tat, now) + interval(rpm)
    return replace(usage, requests_tat=tat, concurrent=usage.concurrent + 1)


def charged(limits: KeyLimits, usage: Usage, tokens: int, now: float) -> Usage:
    """The counters once a job's ``tokens`` (prompt plus completion) are charged at ``now``:
    the tokens bucket may go into debt; the month's count grows (``usage.month_tokens`` must be
    the count of ``now``'s month)."""
    tat = usage.tokens_tat
    if (tpm := limits.tokens_per_minute) is not None:
        tat = max(tat, now) + tokens * interval(tpm)
    return replace(usage, tokens_tat=tat, month_tokens=usage.month_tokens + tokens)
