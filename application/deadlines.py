"""Deadlines of a running job: first token, idle stream, and (optionally) the whole request.

A generation that keeps producing tokens is never cut by the first two: the first-token
deadline runs from the start of execution (queue wait and setup have their own limits,
``QUEUE_TIMEOUT`` and ``SETUP_TIMEOUT``) to the first token, and the idle deadline from each
token to the next. ``request`` caps a request from submission to its end and is off (0) unless
an operator sets ``REQUEST_TIMEOUT``; it is enforced once generation runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from common.contract import JobErrorCode

#: Defaults (seconds): a long prompt on a CPU node can take minutes to its first token.
DEFAULT_FIRST_TOKEN_TIMEOUT = 300.0
DEFAULT_STREAM_IDLE_TIMEOUT = 60.0

#: The error codes a client and the store see for each deadline.
FIRST_TOKEN_TIMEOUT: Final = JobErrorCode.FIRST_TOKEN_TIMEOUT
STREAM_IDLE_TIMEOUT: Final = JobErrorCode.STREAM_IDLE_TIMEOUT
REQUEST_TIMEOUT: Final = JobErrorCode.REQUEST_TIMEOUT
#: Answered 504 (the node did not answer in time) when nothing was sent to the client yet.
DEADLINE_CODES = frozenset({FIRST_TOKEN_TIMEOUT, STREAM_IDLE_TIMEOUT, REQUEST_TIMEOUT})


@dataclass(frozen=True)
class Deadlines:
    first_token: float = DEFAULT_FIRST_TOKEN_TIMEOUT
    stream_idle: float = DEFAULT_STREAM_IDLE_TIMEOUT
    request: float = 0.0  # off

    def __post_init__(self) -> None:
        if self.first_token <= 0 or self.stream_idle <= 0 or self.request < 0:
            raise ValueError("first-token and idle timeouts must be positive; request >= 0")

    def missed(
        self,
        now: float,
        *,
        submitted_at: float,
        executing_since: float | None,
        last_token_at: float | None,
    ) -> tuple[str, str] | None:
        """(error code, message) of the first deadline a job has missed at ``now``, if any
        (all times on one monotonic clock; ``executing_since`` None: still in setup)."""
        if self.request and now - submitted_at > self.request:
            return (
                REQUEST_TIMEOUT,
                f"the request took longer than REQUEST_TIMEOUT={self.request:g}s",
            )
        if executing_since is None:
            return None
        if last_token_at is None:
            if now - executing_since > self.first_token:
                return (
                    FIRST_TOKEN_TIMEOUT,
                    f"no token within FIRST_TOKEN_TIMEOUT={self.first_token:g}s of the start "
                    "of generation",
                )
            return None
        if now - last_token_at > self.stream_idle:
            return (
                STREAM_IDLE_TIMEOUT,
                f"no token for STREAM_IDLE_TIMEOUT={self.stream_idle:g}s",
            )
        return None
