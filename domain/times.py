"""Times shown to people: ISO 8601 in UTC to the second (``2026-12-05T12:00:00Z``), never
unix seconds. Pure."""

from __future__ import annotations

import datetime as dt


def iso_time(unix_seconds: float) -> str:
    """``unix_seconds`` as ``YYYY-MM-DDTHH:MM:SSZ`` (UTC; fractions of a second dropped)."""
    moment = dt.datetime.fromtimestamp(unix_seconds, dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
