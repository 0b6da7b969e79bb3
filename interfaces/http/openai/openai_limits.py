"""A request's hold on its key's limits, as OpenAI answers them: checked before the job is
submitted (429 with ``Retry-After`` and the ``x-ratelimit-*`` headers), settled once when it
ends (:class:`KeyCharge`).

A grant without limits (``AI_API_KEY``, an open cluster) is never checked: no I/O.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from application.ports import RateLimiter
from application.rate_limits import Figures, Limit, LimitDecision, limited
from domain.api_keys import Grant
from interfaces.http.http_errors import ApiError

#: OpenAI's codes for a refusal by a rate (or concurrency) and by the monthly budget.
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
INSUFFICIENT_QUOTA = "insufficient_quota"

#: How each limit is named in a refusal's message, as OpenAI's messages name theirs.
_NAMES = {
    Limit.REQUESTS: "requests per minute (RPM)",
    Limit.TOKENS: "tokens per minute (TPM)",
    Limit.CONCURRENCY: "concurrent requests",
}

_background: set[asyncio.Task[None]] = set()


def duration(seconds: float) -> str:
    """Seconds as OpenAI writes them in ``x-ratelimit-reset-*`` and its messages: ``20ms``,
    ``1.2s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = f"{seconds % 60:.3f}".rstrip("0").rstrip(".") + "s"
    minutes = int(seconds // 60)
    if not minutes:
        return whole
    hours, minutes = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{whole}"


def _figures(kind: str, figures: Figures | None) -> dict[str, str]:
    if figures is None:
        return {}
    return {
        f"x-ratelimit-limit-{kind}": str(figures.limit),
        f"x-ratelimit-remaining-{kind}": str(figures.remaining),
        f"x-ratelimit-reset-{kind}": duration(figures.reset),
    }


def ratelimit_headers(decision: LimitDecision) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of a key with per-minute limits (none without)."""
    return {**_figures("requests", decision.requests), **_figures("tokens", decision.tokens)}


def rate_limited(decision: LimitDecision) -> ApiError:
    """A refusal as OpenAI answers it: 429 ``rate_limit_exceeded`` (type ``requests`` or
    ``tokens``) naming the limit and when to retry, or 429 ``insufficient_quota`` for the
    monthly budget (``x-should-retry: false``: the SDKs do not retry it)."""
    wait = decision.retry_after
    headers = {"Retry-After": str(max(1, math.ceil(wait))), **ratelimit_headers(decision)}
    if decision.refused is Limit.MONTHLY:
        return ApiError(
            429,
            f"You exceeded this key's monthly token budget: Limit {decision.limit}, Used "
            f"{decision.used}. It renews at the start of the next month (UTC), in "
            f"{duration(wait)}.",
            type_=INSUFFICIENT_QUOTA,
            code=INSUFFICIENT_QUOTA,
            headers={**headers, "x-should-retry": "false"},
        )
    refused = decision.refused or Limit.REQUESTS
    return ApiError(
        429,
        f"Rate limit reached for {_NAMES[refused]}: Limit {decision.limit}, Used "
        f"{decision.used}, Requested 1. Please try again in {duration(wait)}.",
        type_="tokens" if refused is Limit.TOKENS else "requests",
        code=RATE_LIMIT_EXCEEDED,
        headers=headers,
    )


class KeyCharge:
    """One admitted request's hold on its key's limits: the headers its answer carries, and
    the settlement (tokens charged, lease released) that must happen exactly once however the
    request ends. Settling runs as a task of its own, so that it also happens from a
    cancelled handler or a stream's closing callback; later calls do nothing."""

    def __init__(
        self,
        limiter: RateLimiter | None,
        grant: Grant,
        decision: LimitDecision,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._limiter = limiter
        self._grant = grant
        self._lease = decision.lease
        self._clock = clock
        self.headers = ratelimit_headers(decision)
        self.settled: asyncio.Task[None] | None = None
        self._done = limiter is None

    def settle(self, prompt_tokens: int, completion_tokens: int) -> None:
        if self._done or self._limiter is None:
            return
        self._done = True
        work = self._limiter.settle(
            self._grant, self._lease, prompt_tokens, completion_tokens, self._clock()
        )
        self.settled = asyncio.get_running_loop().create_task(work)
        _background.add(self.settled)
        self.settled.add_done_callback(_background.discard)


#: The hold of a request whose key has no limit: no headers, nothing to settle.
UNLIMITED = KeyCharge(None, Grant(key_id="", name=""), LimitDecision(True))


async def key_charge(
    limiter: RateLimiter | None, grant: Grant, clock: Callable[[], float] = time.time
) -> KeyCharge:
    """The request's hold on ``grant``'s limits, or :class:`ApiError` 429 when one refuses it.
    Without a limiter (an app built without one) or a limit, nothing is asked."""
    if limiter is None or not limited(grant):
        return UNLIMITED
    decision = await limiter.acquire(grant, clock())
    if not decision.allowed:
        raise rate_limited(decision)
    return KeyCharge(limiter, grant, decision, clock)
