"""Short-lived tickets for the live event feed, so the admin key never goes in a URL.

Browsers' ``EventSource`` cannot send an Authorization header. The dashboard therefore asks
for a ticket with its key in the header (``POST /api/admin/feed-tickets``) and opens the feed
with ``?ticket=``. A ticket is ``<expiry>.<hmac>``: the HMAC-SHA256 of its expiry under a key
derived from ``ADMIN_API_KEY``, so it needs no store, any controller sharing the admin key
accepts it, it names nothing secret, and it stops working after :data:`TICKET_TTL` seconds (a
proxy log or browser history holding it holds nothing of use for long). Changing the admin key
voids every ticket.
"""

from __future__ import annotations

import hashlib
import hmac

#: How long a ticket opens the feed (s); the dashboard asks for a new one to reconnect.
TICKET_TTL = 60.0


def _mac(admin_key: str, expires_at: int) -> str:
    key = hashlib.sha256(b"dacp feed ticket\x00" + admin_key.encode()).digest()
    return hmac.new(key, str(expires_at).encode(), hashlib.sha256).hexdigest()


def issue_ticket(admin_key: str, now: float, ttl: float = TICKET_TTL) -> tuple[str, int]:
    """A ticket valid until ``now + ttl`` (whole seconds), and that expiry."""
    expires_at = int(now + ttl)
    return f"{expires_at}.{_mac(admin_key, expires_at)}", expires_at


def ticket_valid(admin_key: str, ticket: str, now: float) -> bool:
    expiry, _, mac = ticket.partition(".")
    if not expiry.isdigit() or len(expiry) > 12:
        return False
    expires_at = int(expiry)
    return now < expires_at and hmac.compare_digest(mac, _mac(admin_key, expires_at))
