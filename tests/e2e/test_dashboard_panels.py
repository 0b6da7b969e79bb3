"""The dashboard's panels that run the cluster, in a real headless Chromium (Debian's
``chromium``) driven by Playwright, against a real controller (Postgres, Redis, gRPC):

* Charts: the series the page loaded from ``/api/admin/metrics/history`` hold points;
* Models: a model and its holder; register, add a source, pull onto a node, evict from it;
* Add a node: a token and the command line, which a real ``node-agent`` runs to enroll;
* Playground: a chat streamed through ``/v1/chat/completions``, deltas shown as they come.

FakeAgent nodes serve the jobs (the real llama.cpp path is tested in the other e2e tests). A
screenshot of each panel lands in ``test-artifacts/dashboard-<panel>.png``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, ConsoleMessage, Page, expect

from agent.main import build_parser
from bench.synthetic_agents import proof_of
from common.contract import SLOTS_LABEL
from interfaces.controller_main import RunningController, controller
from tests.conftest import controller_settings
from tests.e2e.playground import watch_replies
from tests.e2e.test_dashboard_browser import ARTIFACTS, WAIT_MS, sign_in
from tests.e2e.test_dashboard_browser import browser as browser  # the fixture
from tests.integration.control_client import control_target, inventory
from tests.integration.fake_agent import FakeAgent
from tests.integration.test_control_plane import token, wait_for
from tests.integration.test_job_flow import AI, SHA, register
from wire import control_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

FILE_BYTES = 100 << 20  # every FakeAgent's virtual model file
GPU_TOTAL = 8 << 30
HISTORY_INTERVAL = 0.2  # seconds: the charts fill in a second or two
NODE_AGENT = Path(sys.executable).with_name("node-agent")


class KeepingFakeAgent(FakeAgent):
    """A FakeAgent that reports a GPU and the host CPU with their free memory, and that
    fetches (at once, from any source) and evicts model files as it is told."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.files: dict[str, str] = {self.holds: "m.gguf"} if self.holds else {}
        self.gpu_free = 6 << 30
        self._beats: asyncio.Task[None] | None = None

    def report(self) -> pb.AgentMessage:
        inv = inventory(self.address)
        inv.labels["dacp.memory_limit_bytes"] = str(self.memory)
        inv.labels[SLOTS_LABEL] = str(self.slots)
        inv.devices.extend(
            [
                pb.Device(
                    name="GPU0",
                    description="Fake GPU",
                    kind="gpu",
                    memory_total_bytes=GPU_TOTAL,
                    memory_free_bytes=self.gpu_free,
                ),
                pb.Device(
                    name="CPU",
                    description="host",
                    kind="cpu",
                    memory_total_bytes=8 << 30,
                    memory_free_bytes=6 << 30,
                ),
            ]
        )
        models = [
            pb.LocalModel(
                file_name=file_name,
                size_bytes=FILE_BYTES,
                sha256=sha256,
                layers=30,
                context_length=8192,
                kv_bytes_per_token=23040,
                architecture="llama",
            )
            for sha256, file_name in sorted(self.files.items())
        ]
        return pb.AgentMessage(resource_report=pb.ResourceReport(inventory=inv, models=models))

    async def start(self) -> KeepingFakeAgent:
        await super().start()
        assert self.session is not None
        await self.session.send(self.report())
        self.session.stop_heartbeats()
        self._beats = asyncio.create_task(self._beat())
        return self

    async def _beat(self) -> None:
        assert self.session is not None
        while True:
            devices = [
                pb.DeviceTelemetry(name="GPU0", memory_free_bytes=self.gpu_free),
                pb.DeviceTelemetry(name="CPU", memory_free_bytes=6 << 30),
            ]
            beat = pb.Heartbeat(cpu_percent=5.0, ram_free_bytes=6 << 30, devices=devices)
            await self.session.send(pb.AgentMessage(heartbeat=beat))
            await asyncio.sleep(0.2)

    async def _handle(self, message: pb.ControllerMessage) -> None:
        assert self.session is not None
        kind = message.WhichOneof("payload")
        send = self.session.send
        if kind == "fetch_model":
            fetch = message.fetch_model
            source = fetch.sources[0].node_id or fetch.sources[0].url
            for state, done in ((pb.ModelTransfer.STARTED, 0), (pb.ModelTransfer.COMPLETED, 1)):
                transfer = pb.ModelTransfer(
                    transfer_id=fetch.transfer_id,
                    model_sha256=fetch.model_sha256,
                    state=state,
                    bytes_done=FILE_BYTES * done,
                    size_bytes=FILE_BYTES,
                    source_node_id=source,
                )
                await send(pb.AgentMessage(model_transfer=transfer))
            self.files[fetch.model_sha256] = fetch.file_name
            await send(self.report())
        elif kind == "evict_model":
            sha256 = message.evict_model.model_sha256
            file_name = self.files.pop(sha256, "")
            evicted = pb.ModelEvicted(
                model_sha256=sha256, ok=bool(file_name), file_name=file_name, error="not held"
            )
            await send(pb.AgentMessage(model_evicted=evicted))
            await send(self.report())
        elif kind == "prove_model" and message.prove_model.model_sha256 in self.files:
            await send(pb.AgentMessage(model_proof=proof_of(message.prove_model, FILE_BYTES)))
        else:
            await super()._handle(message)

    async def stop(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
        await super().stop()


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    settings = controller_settings(
        pg_schema, tmp_path, metrics_history_interval=HISTORY_INTERVAL, offline_after=120.0
    )
    async with controller(settings) as running:
        yield running


async def ready(ctl: RunningController, *agents: FakeAgent) -> None:
    read = ctl.services.read_model
    for agent in agents:
        await wait_for(lambda a=agent: (read.get_node(a.node_id) or {}).get("state") == "READY")


async def open_panel(browser: Browser, ctl: RunningController, tab: str) -> tuple[Page, list[str]]:
    """A signed-in page on ``tab``; the list collects the page's errors."""
    expect.set_options(timeout=WAIT_MS)
    page = await browser.new_page(viewport={"width": 1440, "height": 1000})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    # The page's Content-Security-Policy lets in nothing but this controller's own files.

    def refused(message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text:
            problems.append(f"refused by the CSP: {message.text}")

    page.on("console", refused)
    await page.goto(f"http://127.0.0.1:{ctl.http_port}/dashboard")
    await sign_in(page, "test-admin-key")
    await expect(page.locator("#feed-status")).to_have_text("live")
    await page.get_by_role("tab", name=tab).click()
    await expect(page.get_by_role("tab", name=tab)).to_have_attribute("aria-selected", "true")
    return page, problems


async def screenshot(page: Page, panel: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"dashboard-{panel}.png"), full_page=True)


async def test_charts_draw_the_controllers_history(
    ctl: RunningController, browser: Browser
) -> None:
    alpha = await KeepingFakeAgent(
        control_target(ctl), token(), "alpha", holds=SHA, memory=4 << 30, slots=2
    ).start()
    await ready(ctl, alpha)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=20) as c:
        await register(ctl, c)
        for _ in range(3):
            r = await c.post("/v1/chat/completions", headers=AI, json=body)
            assert r.status_code == 200, r.text

    page, problems = await open_panel(browser, ctl, "Charts")
    await expect(page.locator('[data-chart="tokens"] canvas')).to_have_count(1)
    # Every chart holds samples, polled as they come (one every 0.2 s here), and the memory
    # chart a series per device once alpha's heartbeats have named them.
    await page.wait_for_function(
        "() => ['tokens', 'ttft', 'queue', 'utilisation', 'cpu', 'memory']"
        ".every((id) => window.dacpCharts[id] && window.dacpCharts[id].data[0].length >= 5)"
        " && window.dacpCharts.memory.series.length === 3"
    )
    series = await page.evaluate(
        """() => Object.fromEntries(Object.entries(window.dacpCharts).map(([id, plot]) => [
             id, { labels: plot.series.slice(1).map((s) => s.label), data: plot.data }]))"""
    )
    assert any(v and v > 0 for v in series["tokens"]["data"][1]), series["tokens"]
    assert series["ttft"]["labels"] == ["p50", "p95"]
    p50 = [v for v in series["ttft"]["data"][1] if v is not None]
    p95 = [v for v in series["ttft"]["data"][2] if v is not None]
    assert p50 and p95 and min(p50) > 0
    assert set(series["queue"]["data"][1]) == {0}
    assert series["utilisation"]["labels"] == ["alpha"]
    # None before alpha enrolled (the controller samples from its start).
    assert set(series["utilisation"]["data"][1]) - {None} <= {0, 50, 100}
    assert series["utilisation"]["data"][1][-1] is not None
    assert series["cpu"]["labels"] == ["alpha"]
    assert set(series["cpu"]["data"][1]) - {None} == {5.0}  # what its heartbeats say
    assert series["memory"]["labels"] == ["alpha CPU", "alpha GPU0"]
    assert set(series["memory"]["data"][2]) - {None} == {2.0}  # 8 GiB less 6 GiB free
    # New samples keep coming while the panel is open.
    before = len(series["tokens"]["data"][0])
    await page.wait_for_function(f"() => window.dacpCharts.tokens.data[0].length > {before}")
    await expect(page.locator("#charts-summary")).to_contain_text("one every 0.2 s")
    # Back and forth between the tabs: each sample once, in order.
    await page.get_by_role("tab", name="Cluster").click()
    await page.get_by_role("tab", name="Charts").click()
    await page.get_by_role("tab", name="Charts").click()
    await page.wait_for_function(f"() => window.dacpCharts.tokens.data[0].length > {before + 3}")
    times = await page.evaluate("window.dacpCharts.tokens.data[0]")
    assert times == sorted(set(times)), times
    await expect(page.locator("#charts-title")).to_have_text("The cluster over the last 72 seconds")
    await screenshot(page, "charts")
    assert not problems, problems
    await page.close()
    await alpha.stop()


async def test_the_models_panel_registers_pulls_and_evicts(
    ctl: RunningController, browser: Browser
) -> None:
    target = control_target(ctl)
    alpha = await KeepingFakeAgent(target, token(), "alpha", holds=SHA, memory=4 << 30).start()
    beta = await KeepingFakeAgent(target, token(), "beta", memory=4 << 30).start()
    await ready(ctl, alpha, beta)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=20) as c:
        await register(ctl, c)

    page, problems = await open_panel(browser, ctl, "Models")
    m = page.locator('#models-table tr[data-model="m"]')
    await expect(m.locator(".held-by .holder-name")).to_have_text(["alpha"])
    await expect(m.locator(".availability")).to_have_text("available")
    await expect(m.locator(".file-name")).to_have_text("m.gguf")

    # Register a model no node holds.
    other = "cd" * 32
    form = page.locator("#register-form")
    await form.get_by_label("Model name").fill("m2")
    await form.get_by_label("sha256").fill(other)
    await form.get_by_label("File name").fill("m2.gguf")
    await form.get_by_role("button", name="Register").click()
    m2 = page.locator('#models-table tr[data-model="m2"]')
    await expect(m2.locator(".availability")).to_have_text("not available: no node holds it")
    await expect(m2.locator(".held-by")).to_have_text("none")

    # Add a source URL to it (a LAN address: no name to resolve).
    sources = page.locator("#source-form")
    await sources.get_by_label("Model").select_option("m2")
    await sources.get_by_label("URL").fill("https://192.168.77.10/models/m2.gguf")
    await sources.get_by_role("button", name="Add source").click()
    await expect(m2.locator(".source-url")).to_have_text(["https://192.168.77.10/models/m2.gguf"])
    await expect(m2.locator(".availability")).to_have_text("fetched from its source on demand")

    # Pull it onto beta: beta fetches it, proves it holds it, and is listed as its holder.
    await m2.locator('.pull-cell input[data-node="beta"]').check()
    await m2.get_by_role("button", name="Pull").click()
    await expect(m2.locator(".held-by .holder-name")).to_have_text(["beta"])
    await expect(m2.locator(".availability")).to_have_text("available")
    assert beta.files.get(other) == "m2.gguf"
    await expect(
        page.locator('#live-events li[data-code="MODEL_TRANSFER_COMPLETED"]').first
    ).to_be_attached()
    await screenshot(page, "models")

    # Evict it from beta: gone from its disk and from the holders.
    await m2.locator('.holder[data-node="beta"]').get_by_role("button", name="Evict").click()
    await expect(m2.locator(".held-by")).to_have_text("none")
    assert other not in beta.files
    await m.locator('.holder[data-node="alpha"]').get_by_role("button", name="Evict").click()
    await expect(m.locator(".held-by")).to_have_text("none")
    # A refused action says why, in the toast.
    await form.get_by_label("Model name").fill("m3")
    await form.get_by_label("sha256").fill("ef" * 32)
    await form.get_by_label("File name").fill("../m3.gguf")
    await form.get_by_role("button", name="Register").click()
    await expect(page.locator("#toast.bad")).to_contain_text("file_name")
    await expect(page.locator('#models-table tr[data-model="m3"]')).to_have_count(0)
    assert not problems, problems
    await page.close()
    for agent in (alpha, beta):
        await agent.stop()


async def test_add_a_node_gives_a_command_line_that_enrolls(
    ctl: RunningController, browser: Browser, tmp_path: Path
) -> None:
    page, problems = await open_panel(browser, ctl, "Add a node")
    form = page.locator("#add-node-form")
    await expect(page.locator("#add-node-target")).to_have_text(
        f"Agents connect to 127.0.0.1:{ctl.grpc_port} (TLS, pinned to this controller's CA)."
    )
    await expect(form.get_by_label("Agent data dir")).to_have_value("~/.local/share/dacp-agent")
    data_dir = tmp_path / "gamma agent"  # a space: the command quotes it
    await form.get_by_label("Node name").fill("gamma")
    await form.get_by_label("Agent data dir").fill(str(data_dir))
    await form.get_by_role("button", name="Mint token").click()
    minted = (await page.locator("#enrollment-token").text_content()) or ""
    assert minted.startswith("dacp1."), minted
    command = (await page.locator("#agent-command").text_content()) or ""
    words = shlex.split(command)
    assert words[0] == "node-agent"
    args = build_parser().parse_args(words[1:])
    assert args.controller_url == f"127.0.0.1:{ctl.grpc_port}"
    assert args.enrollment_token == minted
    assert args.node_name == "gamma"
    assert args.data_dir == data_dir
    assert not args.insecure
    await expect(page.locator("#add-node-result")).to_contain_text("listens on loopback")
    await screenshot(page, "add-node")

    # The command enrolls a real agent (without llama.cpp; on loopback, as the controller is).
    extra = ["--no-runtime", "--advertise-address", "127.0.0.1", "--transfer-port", "0"]
    agent = await asyncio.create_subprocess_exec(
        str(NODE_AGENT),
        *words[1:],
        *extra,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await page.get_by_role("tab", name="Cluster").click()
        row = page.locator("#nodes-table tbody tr", has_text="gamma")
        await expect(row.locator(".state-cell .badge")).to_have_text(
            re.compile("READY|DEGRADED"), timeout=60_000
        )
        await expect(row.locator(".connected")).to_have_text("yes")
    finally:
        agent.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(agent.wait(), 15)
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    assert not problems, problems
    await page.close()


async def test_the_playground_streams_a_reply(ctl: RunningController, browser: Browser) -> None:
    words = tuple(f" w{i}" for i in range(12))
    alpha = await KeepingFakeAgent(
        control_target(ctl), token(), "alpha", holds=SHA, memory=4 << 30, words=words
    ).start()
    alpha.word_delay = 0.1  # slow enough to watch the deltas arrive
    await ready(ctl, alpha)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=20) as c:
        await register(ctl, c)

    page, problems = await open_panel(browser, ctl, "Playground")
    await expect(page.locator("#playground-model option")).to_have_text(["m"])

    # Without the AI key, /v1 refuses, and the page says what to do.
    await page.get_by_label("Message").fill("hello?")
    await page.get_by_role("button", name="Send").click()
    await expect(page.locator("#playground-status")).to_contain_text("paste the controller's AI")
    await expect(page.locator("#chat-log .msg.assistant.failed")).to_have_count(1)
    await page.get_by_role("button", name="New chat").click()

    await page.get_by_label("AI API key").fill("test-ai-key")
    await page.get_by_label("AI API key").dispatch_event("change")
    await page.get_by_label("Message").fill("Say twelve words")
    await watch_replies(page)
    await page.get_by_role("button", name="Send").click()
    reply = page.locator("#chat-log .msg.assistant .text")
    await expect(reply).to_have_text("".join(words))
    await expect(page.locator("#playground-status")).to_contain_text("12 deltas")
    seen = await page.evaluate("window.__replies")
    partial = {text for text in seen if text and text != "".join(words)}
    assert len(partial) >= 3, seen  # shown delta by delta, not all at the end
    await expect(page.locator("#chat-log .msg.user .text")).to_have_text(["Say twelve words"])
    assert await page.evaluate("sessionStorage.getItem('dacp.aiKey')") == "test-ai-key"
    await screenshot(page, "playground")
    assert not problems, problems
    await page.close()
    await alpha.stop()


async def test_add_a_node_says_when_enrollment_is_off(
    pg_schema: str, tmp_path: Path, browser: Browser
) -> None:
    settings = controller_settings(pg_schema, tmp_path, node_enrollment_secret=None)
    async with controller(settings) as ctl:
        page, problems = await open_panel(browser, ctl, "Add a node")
        await expect(page.locator("#add-node-target")).to_have_text(
            "Enrollment is off: the controller has no NODE_ENROLLMENT_SECRET."
        )
        await expect(page.get_by_role("button", name="Mint token")).to_be_disabled()
        assert not problems, problems
        await page.close()


async def test_the_usage_panel_charts_tokens_per_key_and_model(
    ctl: RunningController, browser: Browser
) -> None:
    from application.commands import ChatPrompt, Submission
    from domain.api_keys import Grant

    alpha = await KeepingFakeAgent(
        control_target(ctl), token(), "alpha", holds=SHA, memory=4 << 30, words=("a", " b")
    ).start()
    await ready(ctl, alpha)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}", timeout=20) as c:
        await register(ctl, c)
    jobs, model = ctl.services.jobs, ctl.services.read_model.get_model("m")
    assert jobs is not None and model is not None
    for key in ("team-a", "team-a", "team-b"):
        grant = Grant(key_id=key, name=key)
        run = await jobs.start(
            Submission("m", ChatPrompt([{"role": "user", "content": "x"}]), grant=grant), model
        )
        while (await run.queue.get()).kind == "deltas":
            pass
    read = ctl.services.read_model
    await wait_for(lambda: sum(r["state"] == "COMPLETED" for r in read.list_jobs()) == 3)

    page, problems = await open_panel(browser, ctl, "Usage")
    await page.wait_for_function("() => window.dacpUsage.plot && window.dacpUsage.report")
    labels = await page.evaluate("window.dacpUsage.plot.series.slice(1).map((s) => s.label)")
    assert labels == ["team-a · m", "team-b · m"]
    tokens = await page.evaluate("window.dacpUsage.plot.data.slice(1).map((d) => d.at(-1))")
    assert tokens == [2 * (7 + 2), 7 + 2]  # a FakeAgent's 7 prompt tokens and 2 words, today
    rows = page.locator("#usage-table tbody tr")
    await expect(rows).to_have_count(3)
    await expect(rows.nth(0)).to_contain_text("team-a")
    await expect(rows.nth(2)).to_contain_text("27")  # the total
    await expect(page.locator("#usage-summary")).to_contain_text("3 requests, 27 tokens")
    await page.locator("#usage-days").select_option("7")
    await page.wait_for_function("() => window.dacpUsage.plot.data[0].length === 7")
    await screenshot(page, "usage")
    assert not problems, problems
    await page.close()
    await alpha.stop()
