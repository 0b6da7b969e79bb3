"""The dashboard on a real local cluster (controller and node agent processes, real llama.cpp,
the test model) in headless Chromium: the playground streams a real model's reply, the models
panel shows the agent holding the model, and the charts draw what the controller sampled,
the agent's own devices included. Screenshots: ``test-artifacts/dashboard-real-*.png``."""

from __future__ import annotations

import pytest
from playwright.async_api import Browser, expect

from ops.local_cluster import MODEL_NAME, AgentSpec, LocalCluster
from tests.e2e.clusters import MIB, cluster_fixture
from tests.e2e.playground import watch_replies
from tests.e2e.test_dashboard_browser import ARTIFACTS, WAIT_MS, sign_in
from tests.e2e.test_dashboard_browser import browser as browser  # the fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


cluster = cluster_fixture(
    "dashboard",
    AgentSpec("agent-a", 0, memory_limit=1024 * MIB, holds_model=True),
    extra_env={"METRICS_HISTORY_INTERVAL": "0.5"},
)


async def test_the_dashboard_runs_a_real_cluster(cluster: LocalCluster, browser: Browser) -> None:
    expect.set_options(timeout=WAIT_MS)
    page = await browser.new_page(viewport={"width": 1440, "height": 1000})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    await page.goto(f"{cluster.url}/dashboard")
    await sign_in(page, cluster.admin_api_key)
    await expect(page.locator("#feed-status")).to_have_text("live")

    # Models: the agent proved it holds the test model.
    await page.get_by_role("tab", name="Models").click()
    row = page.locator(f'#models-table tr[data-model="{MODEL_NAME}"]')
    await expect(row.locator(".held-by .holder-name")).to_have_text(["agent-a"], timeout=60_000)
    await expect(row.locator(".availability")).to_have_text("available")

    # Playground: the model's reply, streamed delta by delta.
    await page.get_by_role("tab", name="Playground").click()
    await page.get_by_label("AI API key").fill(cluster.ai_api_key)
    await page.get_by_label("AI API key").dispatch_event("change")
    await page.locator("#playground-model").select_option(MODEL_NAME)
    await watch_replies(page)
    await page.get_by_label("Message").fill("Name three colours.")
    await page.get_by_role("button", name="Send").click()
    status = page.locator("#playground-status")
    await expect(status).to_contain_text("deltas", timeout=120_000)
    reply = (await page.locator("#chat-log .msg.assistant .text").text_content()) or ""
    assert reply.strip(), await status.text_content()
    seen = await page.evaluate("window.__replies")
    # Streamed: the reply showed in part before it was whole, each part a beginning of it. The
    # agent sends a job's pieces after its first together every 50 ms, so a short reply (the
    # model's "There are none...") comes in two pieces: its first token, then the rest.
    partial = {text for text in seen if text and text != reply}
    assert partial and all(reply.startswith(text) for text in partial), (reply, seen)
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard-real-playground.png"), full_page=True)

    # Charts: the tokens just generated, and the agent's devices as its heartbeats report them.
    await page.get_by_role("tab", name="Charts").click()
    await page.wait_for_function(
        "() => window.dacpCharts.tokens"
        " && window.dacpCharts.tokens.data[1].some((v) => v > 0)"
        " && window.dacpCharts.ttft.data[1].some((v) => v !== null && v > 0)"
        " && window.dacpCharts.memory && window.dacpCharts.memory.series.length > 1",
        timeout=30_000,
    )
    labels = await page.evaluate("window.dacpCharts.memory.series.slice(1).map((s) => s.label)")
    assert "agent-a CPU" in labels, labels  # the host, always among a node's devices
    used = await page.evaluate("window.dacpCharts.memory.data[1].filter((v) => v !== null)")
    assert used and all(v > 0 for v in used), used
    await page.screenshot(path=str(ARTIFACTS / "dashboard-real-charts.png"), full_page=True)
    assert not problems, problems
    await page.close()
