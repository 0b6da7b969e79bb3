"""The dashboard in a real headless Chromium (Debian's ``chromium`` package) driven by
Playwright, against a real controller (Postgres, Redis, gRPC) with a FakeAgent node.

Chromium is the system one (``apt-get install -y chromium``); ``playwright install`` is
never needed. The screenshot lands in ``test-artifacts/dashboard.png``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.integration.control_client import control_target
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token, wait_for
from tests.integration.test_job_flow import AI, SHA, register

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


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    # DEGRADED soon after heartbeats stop, and long before OFFLINE, so the test sees it.
    settings = controller_settings(pg_schema, tmp_path, degraded_after=1.5, offline_after=120.0)
    async with controller(settings) as running:
        yield running


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


async def test_dashboard_shows_the_cluster_live(ctl: RunningController, browser: Browser) -> None:
    expect.set_options(timeout=WAIT_MS)
    base = f"http://127.0.0.1:{ctl.http_port}"
    agent = await FakeAgent(
        control_target(ctl), token(), "alpha", holds=SHA, memory=4 << 30
    ).start()
    assert agent.session is not None
    read = ctl.services.read_model
    await wait_for(lambda: (read.get_node(agent.node_id) or {}).get("state") == "READY")
    async with httpx.AsyncClient(base_url=base, timeout=20) as client:
        await register(ctl, client)
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

    # The finished job, and its timeline on click.
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
