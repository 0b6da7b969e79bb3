"""The deadline policy: first token, idle stream, optional request cap; never a busy stream."""

from __future__ import annotations

import pytest

from application.deadlines import (
    FIRST_TOKEN_TIMEOUT,
    REQUEST_TIMEOUT,
    STREAM_IDLE_TIMEOUT,
    Deadlines,
)

D = Deadlines(first_token=10.0, stream_idle=2.0)


def code(now: float, executing: float | None, last: float | None, d: Deadlines = D) -> str:
    missed = d.missed(now, submitted_at=0.0, executing_since=executing, last_token_at=last)
    return missed[0] if missed else ""


def test_setup_and_queue_wait_do_not_count_towards_the_first_token() -> None:
    assert code(1000.0, None, None) == ""
    assert code(1000.0, 995.0, None) == ""
    assert code(1005.5, 995.0, None) == FIRST_TOKEN_TIMEOUT


def test_a_stream_that_keeps_producing_is_never_cut() -> None:
    assert all(code(t + 1.5, 0.0, float(t)) == "" for t in range(0, 10_000, 1))
    assert code(12.5, 0.0, 10.0) == STREAM_IDLE_TIMEOUT


def test_the_request_cap_is_off_unless_set() -> None:
    assert code(10_000.0, 0.0, 9_999.0) == ""
    capped = Deadlines(first_token=10.0, stream_idle=2.0, request=60.0)
    assert code(61.0, 0.0, 60.5, capped) == REQUEST_TIMEOUT
    assert code(61.0, None, None, capped) == REQUEST_TIMEOUT  # setup included


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError):
        Deadlines(first_token=0)
    with pytest.raises(ValueError):
        Deadlines(request=-1)
