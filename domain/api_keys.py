"""What an inference API key allows: the value types the key book, the limiter, the fair queue
and usage accounting share (issue 25, "teams share the cluster fairly").

A key is an :class:`~domain.api_key.ApiKey` aggregate (its events are its history); a
:class:`Grant` is what a request carries once its key was checked: who it is, which models it
may use, its limits and its priority class. ``AI_API_KEY`` is the bootstrap key
(:data:`BOOTSTRAP`): every model, no limits, interactive.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Priority(StrEnum):
    """A key's priority class in its model's admission queue (``application/admission.py``
    states the rule between them)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


@dataclass(frozen=True)
class KeyLimits:
    """A key's limits; None is no limit.

    ``requests_per_minute`` and ``tokens_per_minute`` (prompt plus completion) are rates,
    ``concurrent_requests`` the requests it may have admitted or running at once,
    ``monthly_tokens`` a budget per calendar month (UTC)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    monthly_tokens: int | None = None

    def recorded(self) -> dict[str, int | None]:
        return {
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "concurrent_requests": self.concurrent_requests,
            "monthly_tokens": self.monthly_tokens,
        }

    def unlimited(self) -> bool:
        return all(value is None for value in self.recorded().values())


NO_LIMITS = KeyLimits()


@dataclass(frozen=True)
class Grant:
    """What a checked key allows a request: its id (recorded with every job), its name, the
    models it may use (None: every model), its limits and its priority class."""

    key_id: str
    name: str
    models: frozenset[str] | None = None
    limits: KeyLimits = NO_LIMITS
    priority: Priority = Priority.INTERACTIVE

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


#: The key id recorded for requests made with ``AI_API_KEY``.
BOOTSTRAP_KEY_ID = "bootstrap"
#: The key id recorded for requests to an open cluster (no ``AI_API_KEY``, no keys).
OPEN_KEY_ID = "open"

BOOTSTRAP = Grant(key_id=BOOTSTRAP_KEY_ID, name="AI_API_KEY")
OPEN = Grant(key_id=OPEN_KEY_ID, name="open cluster")
