"""The live event feed: every event the read model applies, pushed to admin clients over SSE.

The projection follower calls :meth:`EventFeed.on_event` from its own thread once an event
is reflected in the read model (so a client that reacts by re-reading the admin API sees
the change). The feed turns the event into a small JSON message there, hands it to the
event loop with ``call_soon_threadsafe`` and returns at once: the follower never waits for
a client. On the loop each subscriber has a bounded queue; a subscriber that falls behind
loses its *oldest* messages, is told how many with an ``event: gap`` message, and the loss
is counted (``dacp_event_feed_dropped_total``).

``GET /api/admin/events/stream`` (admin key) streams::

    event: ready            data: {"position": <read-model position at connect>}
    data: {"position", "time", "code", "aggregate_id", "kind", "state", "version", "summary"}
    event: gap              data: {"dropped": <n>}   (then refresh from the admin API)
    : keepalive             (a comment, every 15 s without traffic)
    event: session-end      data: {"reason": ...}    (then the stream ends)

Browsers' ``EventSource`` cannot send headers, so this one route also accepts a short-lived
ticket as ``?ticket=`` (``POST /api/admin/feed-tickets``, see ``application/feed_tickets.py``):
the admin key itself never goes in a URL. A stream is authorized again at every wake (a batch,
a keepalive, and the moment its session ends): one opened with a ticket ends when the ticket's
session ends (``ready`` says in how many seconds: ``ends_in``), any one ends once the admin key
it was opened with is no longer the controller's, each with ``event: session-end``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import orjson
from litestar import Request, get
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import QueryParameter
from litestar.response import Stream

from application.feed_tickets import session_end, ticket_valid
from application.timeline import aggregate_kind, entry_of
from interfaces.http.http_auth import bearer, check_admin_key, services_of
from interfaces.http.http_docs import ADMIN_KEY_ERRORS, ApiOperation, errors
from interfaces.http.http_errors import ApiError, ErrorCode, not_running

if TYPE_CHECKING:  # interfaces.services holds an EventFeed: the app resolves the name
    from interfaces.services import Provided, Services

KEEPALIVE_SECONDS = 15.0
QUEUE_SIZE = 1000
RETRY_MS = 3000
FEED_KINDS = frozenset({"node", "job", "model", "access"})

FeedMessage = dict[str, Any]
#: Given the time now (unix s): until when the stream may go on (``math.inf``: no end), or
#: ``None``: not any more (its ticket's session ended, or the admin key changed).
Authorization = Callable[[float], float | None]
SESSION_END_REASON = (
    "the feed's session is over (its ticket's session ended, or the admin key changed): get a"
    " new ticket (POST /api/admin/feed-tickets) and open the feed again"
)


def feed_message(position: int, event: object) -> FeedMessage | None:
    """The feed's JSON for one event; ``None`` for events the feed leaves out (token
    redemptions and other bookkeeping aggregates)."""
    kind = aggregate_kind(event)
    if kind not in FEED_KINDS:
        return None
    entry = entry_of(event, position)
    return {
        "position": position,
        "time": entry["time"],
        "code": entry["code"],
        "aggregate_id": str(getattr(event, "originator_id", "")),
        "kind": kind,
        "state": entry["state"],
        "version": entry["version"],
        "summary": entry["summary"],
    }


@dataclass(frozen=True)
class Gap:
    """``dropped`` messages were lost just before the next one (the subscriber was slow)."""

    dropped: int


class FeedClosed(Exception):
    """The feed is shutting down; the stream ends."""


class Subscription:
    """One client's bounded queue. Used on the event loop only."""

    def __init__(self, feed: EventFeed, maxsize: int) -> None:
        self.feed = feed
        self.maxsize = max(1, maxsize)
        self.dropped = 0
        self._unreported = 0
        self._items: deque[FeedMessage] = deque()
        self._wake = asyncio.Event()
        self._closed = False

    def put(self, message: FeedMessage) -> None:
        if self._closed:
            return
        if len(self._items) >= self.maxsize:
            self._items.popleft()
            self.dropped += 1
            self._unreported += 1
            self.feed.dropped += 1
        self._items.append(message)
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def pending(self) -> int:
        return len(self._items)

    def take(self) -> list[FeedMessage | Gap]:
        """Everything queued now (a gap first when messages were dropped), without waiting."""
        out: list[FeedMessage | Gap] = []
        if self._unreported:
            out.append(Gap(self._unreported))
            self._unreported = 0
        out.extend(self._items)
        self._items.clear()
        self._wake.clear()
        return out

    async def next_batch(self, timeout: float) -> list[FeedMessage | Gap]:
        """Waits up to ``timeout`` seconds for messages; ``[]`` on timeout.

        Raises :class:`FeedClosed` once the feed is closed and the queue is empty.
        """
        if not self._items and not self._unreported:
            if self._closed:
                raise FeedClosed
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
        batch = self.take()
        if not batch and self._closed:
            raise FeedClosed
        return batch


class EventFeed:
    """Broadcasts applied events to subscribers on one asyncio loop."""

    def __init__(
        self, *, queue_size: int = QUEUE_SIZE, keepalive_seconds: float = KEEPALIVE_SECONDS
    ) -> None:
        self.queue_size = queue_size
        self.keepalive_seconds = keepalive_seconds
        self.published = 0
        self.dropped = 0
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[Subscription] = set()
        self._since = 0

    # ---------------------------------------------------- follower thread side

    def bind(self, loop: asyncio.AbstractEventLoop, *, after_position: int = 0) -> None:
        """Delivers on ``loop``, and only events past ``after_position`` (not the history
        the follower may still be catching up on)."""
        self._loop = loop
        self._since = after_position

    def on_event(self, position: int, event: object) -> None:
        """The follower's listener. Quick and non-blocking: never waits for a client."""
        loop = self._loop
        if loop is None or self.closed or position <= self._since or not self._subscribers:
            return
        message = feed_message(position, event)
        if message is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            loop.call_soon_threadsafe(self.publish, message)

    # ------------------------------------------------------------- loop side

    def publish(self, message: FeedMessage) -> None:
        self.published += 1
        for subscription in list(self._subscribers):
            subscription.put(message)

    def subscribe(self, queue_size: int | None = None) -> Subscription:
        subscription = Subscription(self, queue_size or self.queue_size)
        if self.closed:
            subscription.close()
        else:
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)
        subscription.close()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        """Ends every open stream (call before the HTTP server shuts down: it waits for
        open responses to finish)."""
        self.closed = True
        for subscription in list(self._subscribers):
            subscription.close()
        self._subscribers.clear()


# ----------------------------------------------------------------------- HTTP


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def encode(item: FeedMessage | Gap) -> bytes:
    if isinstance(item, Gap):
        return _sse({"dropped": item.dropped}, "gap")
    return _sse(item)


def _always(_now: float) -> float:
    return math.inf


async def sse_stream(
    feed: EventFeed, position: int, authorization: Authorization = _always
) -> AsyncIterator[bytes]:
    """The bytes of one feed stream. Subscribes on first iteration, so a stream that is
    never started holds no queue; unsubscribes however it ends. ``authorization`` is asked
    again at every wake; once it says no, the stream says ``session-end`` and ends (nothing
    that arrived after that is sent)."""

    def left() -> float | None:
        now = time.time()
        until = authorization(now)
        return None if until is None or until <= now else until - now

    ended = _sse({"reason": SESSION_END_REASON}, "session-end")
    subscription = feed.subscribe()
    try:
        remaining = left()
        if remaining is None:
            yield ended
            return
        ready = {"position": position, "ends_in": None if math.isinf(remaining) else remaining}
        yield f"retry: {RETRY_MS}\n".encode() + _sse(ready, "ready")
        while True:
            try:
                batch = await subscription.next_batch(min(feed.keepalive_seconds, remaining))
            except FeedClosed:
                return
            remaining = left()
            if remaining is None:
                yield ended
                return
            yield b"".join(encode(item) for item in batch) if batch else b": keepalive\n\n"
    finally:
        feed.unsubscribe(subscription)


def feed_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The admin guard, also accepting a feed ticket as ``?ticket=`` (EventSource sends no
    headers; the key itself never goes in a URL)."""
    ticket = connection.query_params.get("ticket")
    if ticket is not None and bearer(connection) is None:
        svc = services_of(connection)
        key = svc.settings.admin_api_key
        if key and ticket_valid(key, ticket, time.time()):
            return
        # Malformed tickets (not ASCII, too long) are refused like any wrong one.
        svc.auth_failures[("admin", 401)] += 1
        raise ApiError(
            401,
            "the feed ticket is invalid or expired: get a new one (POST /api/admin/feed-tickets)",
            type_="authentication_error",
            code=ErrorCode.INVALID_TICKET,
        )
    check_admin_key(connection, bearer(connection))


def feed_authorization(svc: Services, key: str | None, ticket: str | None) -> Authorization:
    """How a stream opened with the admin key ``key`` (the header) or else ``ticket`` stays
    authorized: against the controller's admin key as it is at each check."""

    def by_key(_now: float) -> float | None:
        current = svc.settings.admin_api_key
        same = bool(current) and hmac.compare_digest((key or "").encode(), (current or "").encode())
        return math.inf if same else None

    def by_ticket(now: float) -> float | None:
        current = svc.settings.admin_api_key
        return session_end(current, ticket or "", now) if current else None

    return by_key if key is not None else by_ticket


@get(
    "/api/admin/events/stream",
    guards=[feed_guard],
    tags=["admin"],
    security=[{"BearerAuth": []}],
    summary="Live event feed (server-sent events)",
    description=(
        "Every event as the read model applies it: `data: {position, time, code, aggregate_id,"
        " kind (node|job|model|access), state, version, summary}`. Starts with `event: ready` (the"
        " read-model position at connect); `event: gap` says how many messages a slow client"
        " lost (refresh from the admin API); a `: keepalive` comment every 15 s when idle."
        " Authenticate with the Bearer header, or, where headers cannot be sent (browsers'"
        " EventSource), with `?ticket=` from `POST /api/admin/feed-tickets` (it opens the feed"
        " for 60 s; the feed ends when the ticket's session ends, FEED_SESSION_SECONDS after it"
        " was minted: `ready` carries `ends_in` (seconds; null with the header), and"
        " `event: session-end` comes before the end). Any feed ends, with `session-end`, once"
        " the admin key it was opened with is no longer the controller's."
    ),
    media_type="text/event-stream",
    operation_class=ApiOperation,
    responses=errors(400, *ADMIN_KEY_ERRORS, 503),
)
async def event_stream(
    svc: Provided[Services],
    feed: Provided[EventFeed | None],
    request: Request[Any, Any, Any],
    ticket: Annotated[
        str | None,
        QueryParameter(
            name="ticket",
            description="A feed ticket (POST /api/admin/feed-tickets), for clients that cannot "
            "send an Authorization header; never the admin key",
        ),
    ] = None,
) -> Stream:
    if feed is None:
        raise not_running("the event feed is not running")
    return Stream(
        sse_stream(feed, svc.follower.position, feed_authorization(svc, bearer(request), ticket)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
