"""The streamed response sent in the request's own task: a disconnect stops the stream (its
iterator's ``finally`` runs) without the request failing; a cancellation from outside goes on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import RequestFactory

from interfaces.http.event_stream_response import EventStream


class Client:
    """The ASGI side of one client: what was sent to it, and when it leaves."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.leaves = asyncio.Event()

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    async def receive(self) -> Any:
        await self.leaves.wait()
        return {"type": "http.disconnect"}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def _asgi(events: AsyncIterator[bytes]) -> Any:
    request = RequestFactory(app=Litestar()).get("/")
    return EventStream(events, headers={"X-Test": "1"}).to_asgi_response(None, request)


async def test_the_events_go_out_in_order_then_the_body_ends() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    client = Client()
    await _asgi(events())({"type": "http"}, client.receive, client.send)
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-test", b"1") in start["headers"]
    assert client.body == b"data: 1\n\ndata: 2\n\n"
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_a_disconnect_stops_the_stream_and_the_request_ends_quietly() -> None:
    client = Client()
    finished: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            client.leaves.set()
            await asyncio.Event().wait()  # the next token never comes
            yield b"data: never\n\n"
        finally:
            finished.append("finally")

    await asyncio.wait_for(_asgi(events())({"type": "http"}, client.receive, client.send), 5)
    assert finished == ["finally"]
    assert client.body == b"data: first\n\n"
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancellation_from_outside_goes_on() -> None:
    client = Client()
    streaming = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        streaming.set()
        await asyncio.Event().wait()
        yield b"data: never\n\n"

    task = asyncio.create_task(_asgi(events())({"type": "http"}, client.receive, client.send))
    await asyncio.wait_for(streaming.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
