"""The dashboard's Keys panel in a real headless Chromium (Playwright) against a real controller
(Postgres, Redis): a key created there is shown once and works on ``/v1``; revoked there, it
fails at once. A screenshot lands in ``test-artifacts/dashboard-keys.png``."""

from __future__ import annotations

import re

import httpx
import pytest
from playwright.async_api import Browser, Dialog, expect

from interfaces.controller_main import RunningController
from tests.controller_fixture import controller_fixture
from tests.e2e.test_dashboard_browser import ARTIFACTS, WAIT_MS, sign_in
from tests.e2e.test_dashboard_browser import browser as browser  # the fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ctl = controller_fixture()


async def test_the_keys_panel_creates_shows_once_and_revokes(
    ctl: RunningController, browser: Browser
) -> None:
    expect.set_options(timeout=WAIT_MS)
    base = f"http://127.0.0.1:{ctl.http_port}"
    page = await browser.new_page(viewport={"width": 1440, "height": 1000})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))

    async def accept(dialog: Dialog) -> None:
        await dialog.accept()

    page.on("dialog", accept)
    await page.goto(f"{base}/dashboard")
    await sign_in(page, "test-admin-key")
    await page.get_by_role("tab", name="Keys").click()
    await expect(page.locator("#keys-empty")).to_be_visible()

    form = page.locator("#key-form")
    await form.get_by_label("Name").fill("team-a")
    await form.get_by_label("Owner").fill("ml team")
    await form.get_by_label("Models").fill("m1, m2")
    await form.get_by_label("Requests per minute").fill("60")
    await form.get_by_label("Priority").select_option("batch")
    await form.get_by_role("button", name="Create key").click()

    shown = page.locator("#new-key")
    await expect(shown).to_have_text(re.compile(r"^sk-dacp-"))
    key = await shown.inner_text()
    row = page.locator("#keys-table tbody tr", has_text="team-a")
    await expect(row).to_contain_text("ml team")
    await expect(row.locator(".models")).to_have_text("m1, m2")
    await expect(row.locator(".limits")).to_have_text("rpm 60")
    await expect(row.locator(".state")).to_have_text("active")
    assert key not in await page.locator("#keys-table").inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-keys.png"), full_page=True)

    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        auth = {"Authorization": f"Bearer {key}"}
        assert (await client.get("/v1/models", headers=auth)).status_code == 200
        await page.get_by_role("button", name="Done").click()
        await expect(shown).to_have_count(0)  # shown once: gone for good
        await row.get_by_role("button", name="Revoke").click()
        await expect(row.locator(".state")).to_have_text("revoked")
        assert (await client.get("/v1/models", headers=auth)).status_code == 401
    assert problems == []
