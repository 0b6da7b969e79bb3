"""Issue 21, finding 10: feed tickets against a real controller.

- A malformed ticket (a Unicode digit, bytes that are not UTF-8, a NUL, a huge one) is a 401
  ``invalid_ticket`` in the admin API's error JSON, counted in ``dacp_http_auth_failures_total``
  like every other refused key, never a 500.
- A feed opened with a ticket ends when the ticket's session ends (``FEED_SESSION_SECONDS``
  after the admin key minted it): the server says ``event: session-end`` and closes the
  stream, and the ticket opens nothing any more. A new ticket (the key in the header again)
  opens a new feed.
"""

from __future__ import annotations

import re
import ssl
import time
from pathlib import Path

import httpx
import pytest

from interfaces.controller_main import RunningController
from tests.integration.test_metrics_and_feed import feed
from tests.security.conftest import controller_in
from tests.security.netns import Namespace

ADMIN = {"Authorization": "Bearer test-admin-key"}
STREAM = "/api/admin/events/stream"
MALFORMED = [
    "%C2%B2.x",  # a superscript two: str.isdigit() says yes, int() says no
    "%C2%B2%C2%B2.%C2%B2.x",
    "1.%C3%A9",  # a non-ASCII MAC
    f"{int(time.time()) + 30}.{int(time.time()) + 60}.{'%C3%A9' * 64}",
    "%FF%FE.00",  # not UTF-8
    "1.2.%00",
    "9" * 5000,
    "%EF%BC%91%EF%BC%92.00",  # fullwidth digits
]


def _admin_401s(metrics: str) -> float:
    found = re.search(
        r'^dacp_http_auth_failures_total\{api="admin",status="401"\} (\S+)$', metrics, re.M
    )
    return float(found.group(1)) if found else 0.0


async def test_a_malformed_ticket_is_a_counted_401_never_a_500(ctl: RunningController) -> None:
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=10
    ) as client:
        before = _admin_401s((await client.get("/metrics")).text)
        for raw in MALFORMED:
            answer = await client.get(f"{STREAM}?ticket={raw}")
            assert answer.status_code == 401, (raw, answer.status_code, answer.text[:300])
            error = answer.json()["error"]
            assert error["code"] == "invalid_ticket" and error["type"] == "authentication_error"
            assert "Traceback" not in answer.text
        after = _admin_401s((await client.get("/metrics")).text)
        assert after - before == len(MALFORMED)
        # The feed still opens with a good ticket afterwards.
        ticket = (await client.post("/api/admin/feed-tickets", headers=ADMIN)).json()["ticket"]
        async with feed(client, params={"ticket": ticket}) as (response, stream):
            assert response.status_code == 200
            assert (await stream.next())[0] == "ready"


SESSION = 2.0


async def test_a_ticket_feed_ends_when_the_tickets_session_ends(
    namespace: Namespace, tmp_path: Path
) -> None:
    with controller_in(namespace, tmp_path, FEED_SESSION_SECONDS=str(SESSION)) as env:
        trust = ssl.create_default_context(cafile=env["CA"])
        async with httpx.AsyncClient(base_url=env["URL"], verify=trust, timeout=10) as client:
            minted_at = time.time()
            minted = await client.post("/api/admin/feed-tickets", headers=ADMIN)
            assert minted.status_code == 201, minted.text
            ticket = minted.json()["ticket"]
            async with feed(client, params={"ticket": ticket}) as (response, stream):
                assert response.status_code == 200
                event, ready = await stream.next()
                assert event == "ready" and 0 < ready["ends_in"] <= SESSION + 1
                # The server ends the stream once the session is over (keepalives come only
                # every 15 s, so nothing else would end it in this window).
                try:
                    event, data = await stream.next(timeout=SESSION + 4)
                except TimeoutError:
                    pytest.fail(f"the ticket's feed was still open {SESSION + 4:.0f} s later")
                ended_after = time.time() - minted_at
                assert event == "session-end", (event, data)
                assert "feed-tickets" in data["reason"]
                with pytest.raises(EOFError):
                    await stream.next(timeout=5)
            print(f"the feed ended {ended_after:.2f} s after its ticket was minted")
            assert SESSION - 1 <= ended_after <= SESSION + 2
            # The same ticket opens nothing any more (its 60 s are not over yet).
            again = await client.get(STREAM, params={"ticket": ticket})
            assert again.status_code == 401 and again.json()["error"]["code"] == "invalid_ticket"
            # A new ticket, minted with the key in the header, opens a new feed.
            fresh = (await client.post("/api/admin/feed-tickets", headers=ADMIN)).json()
            assert fresh["session_ends_at"] >= time.time()
            async with feed(client, params={"ticket": fresh["ticket"]}) as (response, stream):
                assert response.status_code == 200
                assert (await stream.next())[0] == "ready"
