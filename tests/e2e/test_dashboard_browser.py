"""The dashboard in a real headless Chromium (Debian's ``chromium`` package) driven by
Playwright, against a real controller (Postgres, Redis, gRPC) with a FakeAgent node.

Chromium is the system one (``apt-get install -y chromium``); ``playwright install`` is
never needed. The screenshots land in ``test-artifacts/`` (``dashboard.png``,
``dashboard-transfers.png``, ``dashboard-transfer-failed.png``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from application.commands import FetchRequest, TransferReport, TransferSource
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.controller_fixture import controller_fixture
from tests.integration.control_client import control_target, inventory
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token, wait_for
from tests.integration.test_job_flow import ADMIN, AI, SHA, register
from wire import control_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
WAIT_MS = 20_000  # generous: the machine may be busy with other tests


# DEGRADED soon after heartbeats stop, and long before OFFLINE, so the test sees it.
ctl = controller_fixture(degraded_after=1.5, offline_after=120.0)


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install -y chromium"
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield launched
        finally:
            await launched.close()


async def sign_in(page: Page, key: str) -> None:
    await page.get_by_label("Admin API key").fill(key)
    await page.get_by_role("button", name="Open dashboard").click()


async def live_dashboard(browser: Browser, ctl: RunningController) -> tuple[Page, list[str]]:
    """A page signed in to ``ctl``'s dashboard with its live feed up; the list collects the
    page's errors."""
    page = await browser.new_page(viewport={"width": 1440, "height": 960})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    await page.goto(f"http://127.0.0.1:{ctl.http_port}/dashboard")
    await sign_in(page, "test-admin-key")
    await expect(page.locator("#feed-status")).to_have_text("live")
    return page, problems


async def test_dashboard_shows_the_cluster_live(ctl: RunningController, browser: Browser) -> None:
    expect.set_options(timeout=WAIT_MS)
    base = f"http://127.0.0.1:{ctl.http_port}"
    agent = await FakeAgent(
        control_target(ctl), token(), "alpha", holds=SHA, memory=4 << 30
    ).start()
    assert agent.session is not None
    read = ctl.services.read_model
    await wait_for(lambda: (read.get_node(agent.node_id) or {}).get("state") == "READY")
    # The same long chat twice: the second goes back to the server holding its prefix.
    agent.prompt_tokens, agent.cached_prompt_tokens = 1600, 1536
    long_chat = {"model": "m", "messages": [{"role": "user", "content": "tell me " * 800}]}
    async with httpx.AsyncClient(base_url=base, timeout=20) as client:
        await register(ctl, client)
        turns = []
        for _ in range(2):
            r = await client.post("/v1/chat/completions", headers=AI, json=long_chat)
            assert r.status_code == 200, r.text
            turns.append(str(uuid.UUID(r.json()["id"].removeprefix("chatcmpl-"))))
        r = await client.post(
            "/v1/chat/completions",
            headers=AI,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        job_id = str(uuid.UUID(r.json()["id"].removeprefix("chatcmpl-")))

    page = await browser.new_page(viewport={"width": 1440, "height": 960})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    await page.goto(f"{base}/dashboard")

    # A wrong key is refused and nothing is shown.
    await sign_in(page, "not-the-key")
    await expect(page.locator("#login-error")).to_contain_text("refused")
    await expect(page.locator("#main")).to_be_hidden()

    await sign_in(page, "test-admin-key")
    await expect(page.locator("#main")).to_be_visible()
    await expect(page.locator("#feed-status")).to_have_text("live")
    node = page.locator(f'#nodes-table tr[data-node-id="{agent.node_id}"]')
    badge = node.locator(".state-cell .badge")
    await expect(badge).to_have_text("READY")
    await expect(node.locator(".connected")).to_have_text("yes")
    await expect(node).to_contain_text("alpha")
    assert await page.evaluate("sessionStorage.getItem('dacp.adminKey')") == "test-admin-key"
    assert "test-admin-key" not in await page.content()

    # The finished jobs, with their route and cached tokens, and a timeline on click.
    first, second = (page.locator(f'#recent-jobs tr[data-job-id="{t}"] td.cache') for t in turns)
    await expect(first).to_have_text("miss · 1,536 cached")
    await expect(second).to_have_text(re.compile(r"^hit · 6\.\dk chars · 1,536 cached$"))
    job = page.locator(f'#recent-jobs tr[data-job-id="{job_id}"]')
    await expect(job).to_contain_text("COMPLETED")
    await job.click()
    timeline = page.locator("#timeline-list")
    await expect(timeline.locator('li[data-code="JOB_COMPLETED"]')).to_be_visible()
    await expect(timeline.locator('li[data-code="JOB_SUBMITTED"]')).to_be_visible()

    # Live: heartbeats stop → DEGRADED, without a reload, pushed by the event feed.
    await page.evaluate("window.__sameDocument = true")
    agent.session.stop_heartbeats()
    await expect(badge).to_have_text("DEGRADED")
    await expect(
        page.locator('#live-events li[data-code="HEARTBEAT_TIMEOUT"]').first
    ).to_contain_text(agent.node_id[:8])
    assert await page.evaluate("window.__sameDocument === true"), "the page was reloaded"

    # Heartbeats resume → READY again.
    agent.session.start_heartbeats(0.2)
    await expect(badge).to_have_text("READY")

    # The node's timeline, then Drain from the dashboard.
    await node.locator("td").first.click()
    await expect(page.locator("#timeline-title")).to_contain_text("alpha")
    await expect(timeline.locator('li[data-code="NODE_RECOVERED"]')).to_be_visible()
    await node.get_by_role("button", name="Drain").click()
    await expect(badge).to_have_text("DRAINING")
    await expect(node.get_by_role("button", name="Drain")).to_be_disabled()
    await expect(node.get_by_role("button", name="Resume")).to_be_enabled()
    await expect(timeline.locator('li[data-code="NODE_DRAIN_REQUESTED"]')).to_be_visible()
    await expect(timeline.locator('li[data-code="NODE_DRAINED"]')).to_be_visible()
    await wait_for(lambda: (read.get_node(agent.node_id) or {}).get("state") == "DRAINING")

    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert not problems, problems
    await page.close()
    await agent.stop()


async def test_dashboard_shows_a_queued_job_and_its_place(
    ctl: RunningController, browser: Browser
) -> None:
    expect.set_options(timeout=WAIT_MS)
    base = f"http://127.0.0.1:{ctl.http_port}"
    agent = await FakeAgent(
        control_target(ctl),
        token(),
        "solo",
        holds=SHA,
        memory=4 << 30,
        words=tuple(f" w{i}" for i in range(400)),
    ).start()
    agent.word_delay = 0.05  # the one slot stays busy for the whole test
    read = ctl.services.read_model
    await wait_for(lambda: (read.get_node(agent.node_id) or {}).get("state") == "READY")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        await register(ctl, client)

        async def stream() -> None:
            async with client.stream("POST", "/v1/chat/completions", headers=AI, json=body) as r:
                async for _ in r.aiter_lines():
                    pass

        running = asyncio.create_task(stream())
        await wait_for(lambda: bool(read.list_jobs(state="RUNNING")))
        waiting = asyncio.create_task(stream())
        await wait_for(lambda: bool(read.list_jobs(state="QUEUED")))
        queued_id = read.list_jobs(state="QUEUED")[0]["job_id"]

        page = await browser.new_page(viewport={"width": 1440, "height": 960})
        await page.goto(f"{base}/dashboard")
        await sign_in(page, "test-admin-key")
        row = page.locator(f'#active-jobs tr[data-job-id="{queued_id}"]')
        await expect(row.locator(".state-cell .badge")).to_have_text("QUEUED")
        await expect(row).to_contain_text("queued at #1")
        await page.close()
        for task in (waiting, running):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await agent.stop()


async def test_dashboard_shows_model_transfers_under_way(
    ctl: RunningController, browser: Browser
) -> None:
    """Transfers recorded through the controller's own commands (what the coordinator does
    when a node reports) appear in the transfers panel with their progress and source, move
    as progress comes, and leave it when they complete; a failed one stays, marked failed with
    how far it got and its error, until the node fetches that model after all. Each node shows
    the model files it holds."""
    expect.set_options(timeout=WAIT_MS)
    base = f"http://127.0.0.1:{ctl.http_port}"
    target = control_target(ctl)
    alpha = await FakeAgent(target, token(), "alpha", holds=SHA, memory=4 << 30).start()
    beta = await FakeAgent(target, token(), "beta", memory=4 << 30).start()
    read = ctl.services.read_model
    app = ctl.services.app
    for agent in (alpha, beta):
        await wait_for(lambda a=agent: (read.get_node(a.node_id) or {}).get("state") == "READY")

    page, problems = await live_dashboard(browser, ctl)
    alpha_row = page.locator(f'#nodes-table tr[data-node-id="{alpha.node_id}"]')
    beta_row = page.locator(f'#nodes-table tr[data-node-id="{beta.node_id}"]')
    await expect(alpha_row.locator(".models")).to_have_text("holds m.gguf (100.0 MiB)")
    await expect(beta_row.locator(".models")).to_have_text("holds no model file")
    await expect(page.locator("#transfers-empty")).to_be_visible()

    # beta fetches m.gguf from alpha (a URL next); nothing fetched yet.
    size = 100 << 20
    fetch = FetchRequest(
        str(uuid.uuid4()),
        SHA,
        "m.gguf",
        size,
        (
            TransferSource(alpha.node_id, "127.0.0.1", 50053, "ticket"),
            TransferSource("", "", 0, "", "https://files.lan/models/m.gguf?key=not-shown"),
        ),
    )
    await asyncio.to_thread(app.transfer_started, beta.node_id, fetch)
    row = page.locator(f'#transfers-table tr[data-transfer-id="{fetch.transfer_id}"]')
    await expect(row).to_be_visible()
    await expect(page.locator("#transfers-empty")).to_be_hidden()
    await expect(row.locator("td").first).to_contain_text("beta")
    await expect(row.locator(".file-name")).to_have_text("m.gguf")
    await expect(row.locator(".percent")).to_have_text("0%")
    await expect(row.locator(".bytes")).to_have_text("0 B of 100.0 MiB")
    await expect(row.locator(".source-name")).to_have_text("alpha")
    await expect(row.locator(".source")).to_contain_text("then https://files.lan/models/m.gguf")
    assert "not-shown" not in await page.content()

    # A quarter comes in: pushed by the feed, without a reload.
    await page.evaluate("window.__sameDocument = true")

    async def report(node_id: str, transfer: FetchRequest, state: str, **fields: Any) -> None:
        done = TransferReport(transfer.transfer_id, transfer.sha256, state, **fields)
        await asyncio.to_thread(app.transfer_reported, node_id, done)

    await report(beta.node_id, fetch, "progress", bytes_done=size // 4, size_bytes=size)
    await expect(row.locator(".percent")).to_have_text("25%")
    await expect(row.locator("progress")).to_have_attribute("value", "25")
    await expect(row.locator(".bytes")).to_have_text("25.0 MiB of 100.0 MiB")
    await expect(beta_row.locator(".fetching")).to_have_text("fetching m.gguf 25%")

    # A second transfer, from a URL only, of a file whose size is unknown until it answers.
    other = FetchRequest(
        str(uuid.uuid4()),
        "cd" * 32,
        "big.gguf",
        0,
        (TransferSource("", "", 0, "", "https://files.lan/big.gguf"),),
    )
    await asyncio.to_thread(app.transfer_started, alpha.node_id, other)
    other_row = page.locator(f'#transfers-table tr[data-transfer-id="{other.transfer_id}"]')
    await expect(other_row.locator(".bytes")).to_have_text("0 B so far (size unknown)")
    await expect(other_row.locator(".percent")).to_have_text("")
    await expect(other_row.locator("progress")).not_to_have_attribute("value", re.compile(".+"))
    await expect(other_row.locator(".source-name")).to_have_text("https://files.lan/big.gguf")
    await expect(page.locator("#transfers-count")).to_have_text("2 under way")
    await report(alpha.node_id, other, "progress", bytes_done=1 << 30, size_bytes=2 << 30)
    await expect(other_row.locator(".percent")).to_have_text("50%")
    await expect(other_row.locator(".bytes")).to_have_text("1.0 GiB of 2.0 GiB")
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-transfers.png"), full_page=True)

    # beta's timeline tells the transfer in words.
    await beta_row.locator("td").first.click()
    await expect(
        page.locator('#timeline-list li[data-code="MODEL_TRANSFER_PROGRESS"]')
    ).to_contain_text("fetched 25% (25.0 MiB of 100.0 MiB)")

    # Completed: the row goes; beta reports the file among its models.
    await report(
        beta.node_id,
        fetch,
        "completed",
        bytes_done=size,
        size_bytes=size,
        source_node_id=alpha.node_id,
    )
    await expect(row).to_have_count(0)
    await expect(beta_row.locator(".fetching")).to_have_count(0)
    await expect(
        page.locator('#live-events li[data-code="MODEL_TRANSFER_COMPLETED"]').first
    ).to_contain_text(f"fetched from {alpha.node_id[:8]}")
    assert beta.session is not None
    inv = inventory("127.0.0.1")
    model = pb.LocalModel(file_name="m.gguf", size_bytes=size, sha256=SHA, layers=30)
    await beta.session.send(
        pb.AgentMessage(resource_report=pb.ResourceReport(inventory=inv, models=[model]))
    )
    await expect(beta_row.locator(".models")).to_have_text("holds m.gguf (100.0 MiB)")

    # Failed: the row stays, marked failed, with how far it got, the error and when; the feed
    # says why too.
    await report(alpha.node_id, other, "failed", error="sha256 mismatch")
    await expect(other_row).to_have_class(re.compile(r"\bfailed\b"))
    await expect(other_row.locator(".badge")).to_have_text("FAILED")
    await expect(other_row.locator("td").first).to_contain_text("alpha")
    await expect(other_row.locator(".file-name")).to_have_text("big.gguf")
    await expect(other_row.locator(".percent")).to_have_text("50%")
    await expect(other_row.locator(".bytes")).to_have_text("1.0 GiB of 2.0 GiB")
    await expect(other_row.locator(".error")).to_have_text("sha256 mismatch")
    await expect(other_row.locator(".source-name")).to_have_text("https://files.lan/big.gguf")
    await expect(other_row.locator(".failed-at")).to_contain_text("failed ")
    await expect(page.locator("#transfers-empty")).to_be_hidden()
    await expect(page.locator("#transfers-count")).to_have_text("1 failed")
    await expect(
        page.locator('#live-events li[data-code="MODEL_TRANSFER_FAILED"]').first
    ).to_contain_text("failed: sha256 mismatch")
    await page.screenshot(path=str(ARTIFACTS / "dashboard-transfer-failed.png"), full_page=True)
    # It is the node row's, not the page's: a page opened now shows it too.
    fresh = await browser.new_page()
    await fresh.goto(f"{base}/dashboard")
    await sign_in(fresh, "test-admin-key")
    fresh_failed = fresh.locator(f'#transfers-table tr[data-transfer-id="{other.transfer_id}"]')
    await expect(fresh_failed.locator(".error")).to_have_text("sha256 mismatch")
    await fresh.close()
    # Clicking it opens alpha's timeline, which tells the failure.
    await other_row.click()
    await expect(page.locator("#timeline-title")).to_have_text("Timeline: node alpha")
    await expect(
        page.locator('#timeline-list li[data-code="MODEL_TRANSFER_FAILED"]')
    ).to_contain_text("failed: sha256 mismatch")

    # alpha fetches the same model again: under way above the failure, which stays meanwhile...
    again = FetchRequest(
        str(uuid.uuid4()),
        other.sha256,
        "big.gguf",
        2 << 30,
        (TransferSource("", "", 0, "", "https://mirror.lan/big.gguf"),),
    )
    await asyncio.to_thread(app.transfer_started, alpha.node_id, again)
    again_row = page.locator(f'#transfers-table tr[data-transfer-id="{again.transfer_id}"]')
    await expect(again_row).to_be_visible()
    await expect(page.locator("#transfers-count")).to_have_text("1 under way · 1 failed")
    await expect(page.locator("#transfers-table tbody tr")).to_have_count(2)
    await expect(page.locator("#transfers-table tbody tr").first).not_to_have_class(
        re.compile(r"\bfailed\b")
    )
    await expect(other_row.locator(".error")).to_have_text("sha256 mismatch")
    # ...and once it has the file, the failure leaves too.
    await report(alpha.node_id, again, "completed", source_node_id="https://mirror.lan/big.gguf")
    await expect(again_row).to_have_count(0)
    await expect(other_row).to_have_count(0)
    await expect(page.locator("#transfers-empty")).to_be_visible()
    await expect(page.locator("#transfers-count")).to_have_text("")
    assert await page.evaluate("window.__sameDocument === true"), "the page was reloaded"

    assert not problems, problems
    await page.close()
    for agent in (alpha, beta):
        await agent.stop()


async def test_the_live_feed_outlives_its_tickets_sessions(
    pg_schema: str, tmp_path: Path, browser: Browser
) -> None:
    """Issue 21, finding 10: a feed opened with a ticket ends when the ticket's session ends
    (FEED_SESSION_SECONDS, 2 s here). The dashboard opens the next feed with a new ticket
    before that, and lets the old one go once the new one is ready: events that come all the
    while are each shown once, none lost, and the pill stays "live". When a renewal cannot get
    a ticket, the server ends the feed, and the dashboard reopens it at once, still "live"."""
    expect.set_options(timeout=WAIT_MS)
    settings = controller_settings(pg_schema, tmp_path, feed_session_seconds=2.0)
    async with controller(settings) as ctl:
        base = f"http://127.0.0.1:{ctl.http_port}"
        live_feed = ctl.feed
        page = await browser.new_page(viewport={"width": 1440, "height": 960})
        problems: list[str] = []
        page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
        minted: list[int] = []  # the status of each ticket request
        refuse_next = False

        async def tickets(route: Any) -> None:
            nonlocal refuse_next
            if refuse_next:
                refuse_next = False
                minted.append(503)
                await route.fulfill(status=503, json={"error": {"message": "busy"}})
            else:
                minted.append(201)
                await route.continue_()

        await page.route("**/api/admin/feed-tickets", tickets)
        await page.goto(f"{base}/dashboard")
        await sign_in(page, "test-admin-key")
        pill = page.locator("#feed-status")
        await expect(pill).to_have_text("live")
        await page.evaluate(
            """() => {
              const pill = document.getElementById("feed-status");
              window.__pills = [];
              new MutationObserver(() => window.__pills.push(pill.textContent))
                .observe(pill, { childList: true, characterData: true, subtree: true });
            }"""
        )
        registered = page.locator('#live-events li[data-code="MODEL_REGISTERED"]')

        # Events all through two renewals: each one shown once.
        count = 0
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            started = len(minted)
            while len(minted) < started + 2 or count < 10:
                count += 1
                body = {"name": f"m{count}", "sha256": f"{count:064x}", "file_name": "m.gguf"}
                r = await client.post("/api/admin/models", headers=ADMIN, json=body)
                assert r.status_code == 201, r.text
                await asyncio.sleep(0.15)
            await expect(registered).to_have_count(count)
            assert len(minted) >= 3 and set(minted) == {201}
            await wait_for(lambda: live_feed.subscriber_count == 1)

            # The next renewal gets no ticket: the server ends the feed at its session's end,
            # and the dashboard opens a new one at once.
            refuse_next, before = True, len(minted)
            await wait_for(lambda: len(minted) >= before + 2, timeout=15)
            assert minted[before:] == [503, 201]
            body = {"name": "late", "sha256": "f" * 64, "file_name": "m.gguf"}
            r = await client.post("/api/admin/models", headers=ADMIN, json=body)
            assert r.status_code == 201, r.text
            await expect(registered).to_have_count(count + 1)
        await expect(pill).to_have_text("live")
        pills = await page.evaluate("window.__pills")
        assert set(pills) == {"live"}, pills
        assert await page.locator("#toast.bad").count() == 0
        assert not problems, problems
        await page.close()


async def test_each_node_shows_the_links_it_measured(
    ctl: RunningController, browser: Browser
) -> None:
    """NODE_LINKS_MEASURED reaches the nodes table through the feed: each peer's bandwidth and
    round trip, the fastest first, and a link the node could not measure marked as such."""
    expect.set_options(timeout=WAIT_MS)
    target = control_target(ctl)
    agents = [
        await FakeAgent(target, token(), name, memory=4 << 30).start()
        for name in ("alpha", "beta", "gamma")
    ]
    read = ctl.services.read_model
    for agent in agents:
        await wait_for(lambda a=agent: (read.get_node(a.node_id) or {}).get("state") == "READY")
    alpha, beta, gamma = agents
    page, problems = await live_dashboard(browser, ctl)
    links = {
        gamma.node_id: {"rtt_ms": 5.12, "mbps": 95.3, "error": ""},
        beta.node_id: {"rtt_ms": 0.21, "mbps": 941.0, "error": ""},
    }
    await asyncio.to_thread(ctl.services.app.record_links, alpha.node_id, links)
    row = page.locator(f'#nodes-table tr[data-node-id="{alpha.node_id}"] .links')
    await expect(row).to_have_text("links: beta 941 Mbit/s, 0.2 ms · gamma 95 Mbit/s, 5.1 ms")
    failed = {beta.node_id: {"rtt_ms": 0.0, "mbps": 0.0, "error": "connect refused"}}
    await asyncio.to_thread(ctl.services.app.record_links, alpha.node_id, failed)
    await expect(row).to_have_text("links: beta unmeasured")
    await expect(row.locator(".link.failed")).to_have_attribute("title", re.compile("refused"))
    assert not problems, problems
    await page.close()
    for agent in agents:
        await agent.stop()
