"""Short-lived tickets for the live event feed, so the admin key never goes in a URL.

Browsers' ``EventSource`` cannot send an Authorization header. The dashboard therefore asks
for a ticket with its key in the header (``POST /api/admin/feed-tickets``) and opens the feed
with ``?ticket=``. A ticket is ``<expires_at>.<session_ends_at>.<hmac>``: two unix times in
whole seconds and the HMAC-SHA256 of both under a key derived from ``ADMIN_API_KEY``. So it
needs no store, any controller sharing the admin key accepts it, it names nothing secret, and:

- it *opens* a feed for :data:`TICKET_TTL` seconds (a proxy log or browser history holding
  it holds nothing of use for long);
- a feed it opened ends at ``session_ends_at``: ``FEED_SESSION_SECONDS`` (default
  :data:`DEFAULT_FEED_SESSION_SECONDS`) after the admin key was last presented to mint it.
  The dashboard then mints a new ticket, with the key in the header, and reopens the feed;
- changing the admin key voids every ticket, and the feeds they opened (checked again at
  every wake of the stream).

Tickets are ASCII only: anything else (a Unicode digit that ``str.isdigit`` accepts and
``int`` refuses, bytes that are not UTF-8) is simply not a ticket.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from dataclasses import dataclass

#: How long a ticket opens the feed (s); the dashboard asks for a new one to reconnect.
TICKET_TTL = 60.0
#: How long a feed opened with a ticket lasts, from the ticket's minting (s).
DEFAULT_FEED_SESSION_SECONDS = 15 * 60.0
#: Digits of a unix time in a ticket (enough until the year 33658).
_TIME_DIGITS = 12
_TICKET = re.compile(rf"([0-9]{{1,{_TIME_DIGITS}}})\.([0-9]{{1,{_TIME_DIGITS}}})\.([0-9a-f]{{64}})")
#: The longest string that can be a ticket.
MAX_TICKET_LENGTH = 2 * _TIME_DIGITS + 2 + 64


@dataclass(frozen=True)
class FeedTicket:
    ticket: str
    #: Until when (unix s) the ticket opens a feed.
    expires_at: int
    #: When (unix s) a feed opened with it ends.
    session_ends_at: int


def _mac(admin_key: str, signed: str) -> str:
    key = hashlib.sha256(b"dacp feed ticket\x00" + admin_key.encode()).digest()
    return hmac.new(key, signed.encode(), hashlib.sha256).hexdigest()


def issue_ticket(
    admin_key: str,
    now: float,
    *,
    session_seconds: float = DEFAULT_FEED_SESSION_SECONDS,
    ttl: float = TICKET_TTL,
) -> FeedTicket:
    """A ticket that opens the feed until ``now + ttl``, for a session ending
    ``session_seconds`` from now (whole seconds, rounded up; never before it stops opening)."""
    if session_seconds <= 0 or ttl <= 0:
        raise ValueError("a feed ticket's lifetime and session must be positive")
    session_ends_at = math.ceil(now + session_seconds)
    expires_at = min(math.ceil(now + ttl), session_ends_at)
    signed = f"{expires_at}.{session_ends_at}"
    return FeedTicket(f"{signed}.{_mac(admin_key, signed)}", expires_at, session_ends_at)


def _verified(admin_key: str, ticket: str) -> tuple[int, int] | None:
    """``(expires_at, session_ends_at)`` of a genuine ticket under ``admin_key``; ``None`` for
    anything else (forged, altered, another key's, malformed, not ASCII). Never raises."""
    if len(ticket) > MAX_TICKET_LENGTH or not ticket.isascii():
        return None
    parts = _TICKET.fullmatch(ticket)
    if parts is None:
        return None
    # The MAC covers the text as sent: one spelling per ticket (no leading zeros added).
    if not hmac.compare_digest(parts[3], _mac(admin_key, f"{parts[1]}.{parts[2]}")):
        return None
    return int(parts[1]), int(parts[2])


def ticket_valid(admin_key: str, ticket: str, now: float) -> bool:
    """Whether ``ticket`` opens a feed at ``now``."""
    times = _verified(admin_key, ticket)
    return times is not None and now < min(times)


def session_end(admin_key: str, ticket: str, now: float) -> int | None:
    """When the session of a feed ``ticket`` opened ends, while it has not ended at ``now``
    under the current ``admin_key``; ``None`` once it has (or the key changed)."""
    times = _verified(admin_key, ticket)
    return times[1] if times is not None and now < times[1] else None
